"""One JSON object per log line (``layerfs daemon --log-format json``), for a
log pipeline: ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger``, ``message``, and ``exception`` (the traceback) when there is one."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(
                   timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def log_json() -> None:
    """Every handler of the root logger writes JSON lines from now on."""
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonLogFormatter())
