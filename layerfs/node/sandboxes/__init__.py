"""Sandboxes on a node: their lifecycle and state, the layer mounts under them, limits,
quota and room on ROOT.

Modules: ``dataloss``, ``layermounts``, ``lifecycle``, ``limits``, ``manager``,
``quota``, ``rootspace``."""
