"""The daemon: its composition and request handlers, the control server, systemd notify,
metrics, JSON logs, forgetting sandboxes.

Modules: ``controlserver``, ``events``, ``forget``, ``jsonlog``, ``metrics``,
``service``, ``systemd``."""
