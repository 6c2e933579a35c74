"""The node daemon as a service (the symptom: it will not start, stop, or answer).

- ``service``: the daemon (``Daemon``): composition, host checks, request handlers
- ``controlserver``: the daemon's end of the control API (``ROOT/control.sock``)
- ``systemd``: readiness and status to systemd
- ``metrics``: the Prometheus metrics
- ``jsonlog``: one JSON object per log line
- ``forget``: forgetting layers no sandbox used for a while
- ``events``: the lifecycle lines on-call reads (up, down, commit, start, stop)
"""
