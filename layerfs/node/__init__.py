"""The node daemon: metadata replica, lazy blob files over FUSE, EROFS and
overlayfs mounts, sandboxes, and the control API the CLI talks to."""
