"""MicroVM drives: disk files (sealed LSMT layers), the disk manager, a VM's drive sets and
the VMM's arguments.

Modules: ``diskfiles``, ``disks``, ``drivesets``, ``pmem``, ``snapshots``, ``vmmargs``."""
