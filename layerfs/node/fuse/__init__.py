"""FUSE: the filesystem adapter over the blob files, the kernel connection, and the keeper
that holds /dev/fuse across daemon restarts.

Modules: ``connection``, ``keeper``, ``nodefs``."""
