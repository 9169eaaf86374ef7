"""API process: ``python -m services.api`` (or ``epd api``)."""

from __future__ import annotations

import uvicorn

from shared.config import ApiSettings
from shared.logs import setup_logging
from shared.topology import Service


def main() -> None:
    settings = ApiSettings()
    setup_logging(settings.log_level, service=Service.API, fmt=settings.log_format)
    from services.api.app import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,  # keep our log format (request_id on every line)
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
