"""The service's log format: one JSON object per line, on standard error.

Set up by the process that serves (`python -m app`, or the factory under
`uvicorn --factory` / gunicorn), never by the library nor by tests.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any


class JsonLines(logging.Formatter):
    """A record as one JSON line: time, level, logger, then its fields or its message."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line |= fields
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure_logging(level: str) -> None:
    """Every logger of the process writes JSON lines at `level` and above.

    uvicorn's access logger is silenced: the audit line (app/request_log.py) is the
    one line per request, and it leaves query strings out.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").disabled = True
