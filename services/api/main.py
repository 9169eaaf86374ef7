"""API process: ``python -m services.api`` (or ``epd api``)."""

from __future__ import annotations

import ssl
from typing import Any

import uvicorn

from shared.config import ApiSettings
from shared.logs import setup_logging
from shared.topology import Service

#: A stopping API waits ``EPD_DRAIN_S`` for the requests in flight; those still running this long
#: before that end with a JSON 503 (uvicorn would cut them off with a plain-text 500).
STOP_REQUESTS_BEFORE_S = 2


class ApiServer(uvicorn.Server):
    """uvicorn's server, telling the app when a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Any):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def tls_options(settings: ApiSettings) -> dict[str, Any]:
    """uvicorn's options for HTTPS with ``EPD_TLS_CERT`` / ``EPD_TLS_KEY`` (none: plain HTTP). The
    pair is loaded here first, so a missing file or a key that is not the certificate's stops the
    start-up with a line naming the settings (``SystemExit``), not in uvicorn's traceback; the
    message names the files, never their contents."""
    if settings.tls_cert is None or settings.tls_key is None:
        return {}
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:  # (ssl.SSLError is an OSError; named for the reader)
        raise SystemExit(
            f"epd api: cannot serve HTTPS with EPD_TLS_CERT={settings.tls_cert} and EPD_TLS_KEY={settings.tls_key}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}


def main() -> None:
    settings = ApiSettings()
    setup_logging(settings.log_level, service=Service.API, fmt=settings.log_format)
    tls = tls_options(settings)  # (before the app: a bad pair fails at once)
    from services.api.app import create_app

    app = create_app(settings, freeze_heap=True)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep our log format (request_id on every line)
        access_log=False,  # the app writes its own (epd.access: duration and request id; EPD_ACCESS_LOG)
        timeout_graceful_shutdown=max(1, round(settings.drain_s)),
        **tls,
    )
    grace = max(0.0, settings.drain_s - STOP_REQUESTS_BEFORE_S)
    ApiServer(config, on_exit=lambda: app.state.service.begin_shutdown(grace)).run()


if __name__ == "__main__":
    main()
