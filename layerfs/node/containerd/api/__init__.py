"""containerd's snapshots API (``containerd.services.snapshots.v1``) as Python code.

``mount.proto`` and ``snapshots.proto`` are containerd 1.6.20's
(``api/types/mount.proto``, ``api/services/snapshots/v1/snapshots.proto``,
Apache License 2.0) with the gogoproto imports and options removed and the
import path renamed to this folder; the wire format and the service's name
are containerd's. ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` are
generated from them by ``make protos`` (grpcio-tools' ``protoc``, run from the
repository's root so that the generated imports are ``layerfs.node.containerd.api``)
and checked in: nothing is generated at install time. Do not edit them.
"""
