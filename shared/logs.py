"""Logging set-up: every line carries the request_id of the work it belongs to ("-" if none)."""

from __future__ import annotations

import contextvars
import logging
import sys

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s [request_id=%(request_id)s] %(message)s"


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


def setup_logging(level: str = "INFO", *, service: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Chatty libraries: keep their warnings, drop their per-request info lines.
    for noisy in ("httpx", "urllib3", "nats", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if service:
        logging.getLogger(__name__).debug("logging ready for %s", service)
