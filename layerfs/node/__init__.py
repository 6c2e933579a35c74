"""The node daemon: metadata replica, lazy blob files over FUSE, EROFS and
overlayfs mounts, sandboxes, and the control API the CLI talks to.

``layerfs.node.Client(root)`` is the Python API of a running node (see
:mod:`.client`); importing it loads no daemon code."""

from .client import Client

__all__ = ["Client"]
