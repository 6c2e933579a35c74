"""containerd's snapshotter served by the node: the gRPC service, its snapshot store, the
generated API.

Modules: ``snapshotter``, ``snapstore``, ``api``."""
