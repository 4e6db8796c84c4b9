"""Logging for the long-running processes (operator, loader, router, engine): plain text for a
terminal, or one JSON object per line for a cluster's log pipeline.

The JSON records carry the keys kopf's JSON format uses (`timestamp`, `severity`, `message`),
so the operator's lines (written by kopf's own formatter) and the loaders' and routers' lines
parse alike; `logger`, the exception (`exc_info`) and any `extra=` fields come along.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from typing import Any, Final, Literal

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
#: The environment variable every component reads its default log format from.
LOG_FORMAT_ENV: Final = "HOTLOAD_LOG_FORMAT"
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every `LogRecord` has: whatever else a record carries came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def default_log_format() -> str:
    """`$HOTLOAD_LOG_FORMAT`, or `text`."""
    return os.environ.get(LOG_FORMAT_ENV, "text") or "text"


def severity(levelno: int) -> str:
    """kopf's severity words for a log level."""
    if levelno <= logging.DEBUG:
        return "debug"
    if levelno <= logging.INFO:
        return "info"
    if levelno <= logging.WARNING:
        return "warn"
    return "error" if levelno <= logging.ERROR else "fatal"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: timestamp (RFC 3339, UTC), severity, logger, message, the
    exception if any, and the record's `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        doc: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "severity": severity(record.levelno),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        return json.dumps(doc, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Send the root logger's records to stderr at `level` (debug, info, warning, error), as
    text or as JSON lines; raises ValueError naming the bad value."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level must be debug, info, warning or error, not {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
