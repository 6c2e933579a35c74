"""The node's knowledge of the store (the symptom: a ref that does not resolve,
a node that works offline or not).

- ``replica``: the metadata replica, so that lookups never leave the node
- ``noderefs``: the refs an ``up`` names, resolved through the store or the node's last answer
- ``storehealth``: whether the store answers, as the daemon last found out
- ``metacheck``: the structural check of meta images, in processes of their own
- ``leaser``: this node's lease in the store and the revocations it copies
"""
