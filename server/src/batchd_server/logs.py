"""Logging to stderr as text for people or as JSON lines for log collectors (``--log-format``)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from batchd_server.settings import EVERY_COMMAND, one_of, setting

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LogSettings",
    "configure_logging",
    "current_log_format",
    "session_log_id",
]

LOG_FORMATS: Final = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SESSION_LOG_ID_CHARS = 8


@dataclass(frozen=True, kw_only=True)
class LogSettings:
    """Logging's server setting (composed into ``ServerConfig`` by ``config.py``)."""

    log_format: str = setting(
        flag="--log-format",
        default="text",
        check=one_of(LOG_FORMATS),
        help="log to stderr as text (one line per record) or json (one object per line, "
        "for log collectors)",
        metavar="{" + ",".join(LOG_FORMATS) + "}",
        commands=(EVERY_COMMAND,),
    )


def session_log_id(session_id: str) -> str:
    """A session id as log lines show it: its first 8 characters (``'3f9a01bc...'``), enough
    to follow one session through a server's log. The whole id is a credential (whoever has
    it may stream the session's batches), and logs travel further than the server."""
    return repr(session_id[:_SESSION_LOG_ID_CHARS] + "...")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, plus ``process`` and ``thread`` names, and ``exception`` with the traceback
    when there is one. A message never spans lines, so a collector never splits a record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.processName,
            "thread": record.threadName,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(level: str | int, log_format: str = "text") -> None:
    """Send every logger's records at ``level`` and above to stderr in ``log_format``.

    Replaces handlers a previous call installed (tests call ``main`` many times).
    """
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_batchd", False):
            root.removeHandler(old)
    handler._batchd = True  # type: ignore[attr-defined]
    if not any(not getattr(h, "_batchd", False) for h in root.handlers):
        root.addHandler(handler)
    root.setLevel(level)


def current_log_format() -> str:
    """``json`` when :func:`configure_logging` set up JSON lines in this process, else ``text``
    (what a worker process started from here should use)."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_batchd", False) and isinstance(handler.formatter, JsonFormatter):
            return "json"
    return "text"
