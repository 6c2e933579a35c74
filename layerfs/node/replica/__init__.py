"""The node's copy of the store's metadata: the replica, the node's refs, the store's
health and the meta image checker.

Modules: ``leaser``, ``metacheck``, ``noderefs``, ``replica``, ``storehealth``."""
