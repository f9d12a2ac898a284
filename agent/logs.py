"""Logging set-up for the daemons: one line per record, JSON for log pipelines or text for people.

Both formats carry the `extra=` fields: JSON as top-level keys, text as `key=value` after the message.
"""

from __future__ import annotations

import json
import logging
import sys

from agent.times import rfc3339

FORMATS = ("json", "text")
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra=` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": rfc3339(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`; values with spaces or quotes are JSON-quoted."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in _fields(record).items())
        return f"{line} {pairs}" if pairs else line


def _text_value(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return json.dumps(text)


def setup(log_format: str = "text", level: int = logging.INFO) -> None:
    """Send every record to stderr in `log_format`; ValueError names the formats for anything else."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif log_format == "text":
        handler.setFormatter(TextFormatter())
    else:
        raise ValueError(f"unknown log format {log_format!r} (choose json or text)")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
