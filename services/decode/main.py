"""Decode worker process: ``python -m services.decode`` (or ``epd decode``)."""

from __future__ import annotations

from shared.config import DecodeSettings
from shared.logs import setup_logging
from shared.topology import Role, Service
from shared.worker import run_worker


def main() -> None:
    settings = DecodeSettings()
    setup_logging(settings.log_level, service=Service.DECODE, fmt=settings.log_format)
    from shared.model_worker import bind_cpus_or_exit, exit_unless_engine_fits

    exit_unless_engine_fits(settings.model, Role.DECODE)  # refuse before loading anything
    bind_cpus_or_exit(settings.runtime)
    from services.decode.handler import DecodeHandler

    # Every job in flight is one row of the engine's batch.
    run_worker(DecodeHandler(settings), settings, concurrency=settings.max_batch_size)


if __name__ == "__main__":
    main()
