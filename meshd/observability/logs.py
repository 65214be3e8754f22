"""Log output of meshd processes: `text` lines for people, `json` lines for log collectors.

JSON: one object per line with `time` (UTC, ISO 8601, ms), `level`, `logger`, `message`,
`exception` (the formatted traceback) when there is one, and every extra field the record
carries (e.g. the per-invocation log's `modelId`, `durationMs`).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has: anything else on a record is an extra field.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        return json.dumps(out, default=str)


def parse_log_format(value: str) -> str:
    """ValueError unless `text` or `json` (any case)."""
    fmt = value.strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"must be text or json, got {value!r}")
    return fmt


def setup_logging(level: str, fmt: str = "text") -> None:
    """Root logging to stderr in `fmt` (see `parse_log_format`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
