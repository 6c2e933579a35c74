"""Sandboxes on a node: what ``up``/``down``/``commit``/``suspend`` do (the symptom: a
sandbox that will not come up, go down, commit or suspend).

- ``manager``: the sandboxes on one node (``Sandboxes``), their up, down and commit
- ``lifecycle``: a sandbox's states and the moves allowed between them
- ``layermounts``: each layer mounted once per node, shared by its sandboxes
- ``limits``: memory, CPU and process limits, checked against the node's cgroups
- ``quota``: the kernel-enforced quota of a sandbox's writable layer (btrfs, or an ext4 image)
- ``rootspace``: room on ROOT's file system, which everything on the node shares
- ``suspend``: a sandbox suspended into the store (its upper as a layer and an env)
- ``dataloss``: the sandboxes and vms whose layer data the store lost (``data_lost``)
"""
