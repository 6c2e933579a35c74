"""containerd's snapshotter served by the node (the symptom: containerd cannot
prepare or mount a snapshot).

- ``snapshotter``: the gRPC snapshots service (a proxy plugin)
- ``snapstore``: containerd's snapshots as the node keeps them, records in the replica
- ``api``: containerd's snapshots API, generated code (``make protos``)
"""

import os

# grpcio (1.81 and later) restarts its poller thread in a forked child; a child
# that closes its descriptors before exec (subprocess's close_fds) can then abort
# on EBADF before it runs its program (grpc/grpc#43055; seen once in this suite).
# The daemon forks (meta checkers, runc, mounts) while it serves gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
