"""Logging set-up: every line carries the request_id of the work it belongs to ("-" if none)."""

from __future__ import annotations

import contextvars
import enum
import json
import logging
import sys
from collections.abc import Mapping

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s [request_id=%(request_id)s] %(message)s"


#: uvicorn logs its own start-up, shutdown and errors under "uvicorn.error" (its access log under
#: "uvicorn.access", which the API replaces with ``epd.access``): shown as "uvicorn"
_RENAMED_LOGGERS = {"uvicorn.error": "uvicorn"}


class RequestIdFilter(logging.Filter):
    """Adds the record's ``request_id`` (the context's, unless the call passed one in ``extra``)
    and shows a library logger whose name misleads under a plain one (``uvicorn.error``: its
    start-up lines are no errors)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        renamed = _RENAMED_LOGGERS.get(record.name)
        if renamed is not None:
            record.name = renamed
        return True


def plain(mapping: Mapping[str, object], *, key_chars: int = 12) -> str:
    """``mapping`` for a log line: ``key=value`` pairs, each value as ``str()`` (an enum member
    as its value, not its repr), keys (hashes) shortened to ``key_chars``; ``-`` when empty."""
    if not mapping:
        return "-"
    return ",".join(f"{k[:key_chars]}={v}" for k, v in mapping.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, pid, logger, request_id, message (+ exc)."""

    def __init__(self, service: str = ""):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "pid": record.process,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class LogFormat(enum.StrEnum):
    """How log lines are written (``EPD_LOG_FORMAT``)."""

    #: one line, ``LOG_FORMAT``
    TEXT = "text"
    #: one JSON object per line (:class:`JsonFormatter`)
    JSON = "json"


def setup_logging(level: str = "INFO", *, service: str = "", fmt: LogFormat = LogFormat.TEXT) -> None:
    """Root logging to stderr, written as ``fmt`` says."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == LogFormat.JSON else logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Chatty libraries: keep their warnings, drop their per-request info lines.
    for noisy in ("httpx", "urllib3", "nats", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if service:
        logging.getLogger(__name__).debug("logging ready for %s", service)
