"""containerd's snapshotter served by the node (the symptom: containerd cannot
prepare or mount a snapshot).

- ``snapshotter``: the gRPC snapshots service (a proxy plugin)
- ``snapstore``: containerd's snapshots as the node keeps them, records in the replica
- ``api``: containerd's snapshots API, generated code (``make protos``)
"""
