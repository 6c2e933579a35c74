"""MicroVM drives on a node (the symptom: a ``vm up`` or a disk that misbehaves).

- ``diskfiles``: block disks, sealed LSMT chains read lazily and writable disks
- ``disks``: the writable disks a node keeps (``DiskManager``)
- ``drivesets``: a VM's drive sets, node state like sandboxes (``Vms``)
- ``vmmargs``: what a VMM needs from a drive set (QEMU's drive arguments)
- ``pmem``: a layer's blob padded for a VMM to map as a virtio-pmem drive
- ``snapshots``: a vm suspended into the store and resumed (RAM, state, disks)
- ``ramwarm``: a resumed vm's working set put into its RAM file's page cache
- ``residency``: the pages of its RAM file a VMM has mapped (what a resume touched)
"""
