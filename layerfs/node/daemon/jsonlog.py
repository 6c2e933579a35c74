"""One JSON object per log line (``layerfs daemon --log-format json``), for a
log pipeline: ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger``, ``message``, and ``exception`` (the traceback) when there is one,
then the record's own fields, given by the code as ``extra=`` (the
lifecycle lines' ``sandbox``, ``env``, ``layers``, ``layer_refs``,
``digest``, ``duration``, ...: layerfs/node/daemon/events.py), then the fields of
the work the line was logged in (:data:`LOG_CONTEXT`: a FUSE read's
``layer``, ``offset`` and ``size``, set by layerfs/node/daemon/metrics.py's
``MeteredFS``: the error lines of a failed read name the layer), each a JSON
value (what JSON cannot hold as its string). A field never replaces one
given before it.
The daemon's keeper (started by it, sharing its stderr) logs the same way: the
format is passed on in ``LAYERFS_LOG_FORMAT`` (the keeper formats its lines
itself, as it imports nothing of layerfs)."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

from ...logcontext import LOG_CONTEXT

LOG_FORMAT_ENV = "LAYERFS_LOG_FORMAT"  # "json" in the environment of the daemon's children


# what every LogRecord has: anything else on a record came from ``extra=``
STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}


def extra_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields given to the record with ``extra=``."""
    return {k: v for k, v in record.__dict__.items() if k not in STANDARD}


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        for key, value in extra_fields(record).items():
            doc.setdefault(key, value)
        for key, value in (LOG_CONTEXT.get() or {}).items():
            doc.setdefault(key, value)
        return json.dumps(doc, ensure_ascii=False, default=str)


def log_json() -> None:
    """Every handler of the root logger writes JSON lines from now on (the
    processes started from now on too, see LOG_FORMAT_ENV)."""
    os.environ[LOG_FORMAT_ENV] = "json"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonLogFormatter())

