"""FUSE (the symptom: ``ROOT/fuse`` hangs, errs, or is gone after a restart).

- ``nodefs``: the FUSE adapter, ``ROOT/fuse`` with the blob files and writable disks
- ``connection``: the FUSE connection as a thing of its own, outliving the daemon
- ``keeper``: the process that holds ``/dev/fuse`` open while daemons come and go
- ``keeperlink``: the daemon's end of its lease: the keeper's pre-content events, answered
"""
