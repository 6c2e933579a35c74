"""The fields of the work under way, for the JSON log lines logged within it.

A trio task sets them (the tasks and worker threads it starts inherit them,
as context variables are); :mod:`layerfs.node.daemon.jsonlog` adds them to
every JSON line. Kept in the core, apart from the formatter, so that any
layer of the node (the read path included) can name what it is doing.
"""

from __future__ import annotations

from contextvars import ContextVar

LOG_CONTEXT: ContextVar[dict[str, object] | None] = ContextVar("layerfs_log_context",
                                                              default=None)
