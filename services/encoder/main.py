"""Encoder worker process: ``python -m services.encoder`` (or ``epd encoder``)."""

from __future__ import annotations

from shared.config import EncoderSettings
from shared.logs import setup_logging
from shared.topology import Role, Service
from shared.worker import run_worker


def main() -> None:
    settings = EncoderSettings()
    setup_logging(settings.log_level, service=Service.ENCODER, fmt=settings.log_format)
    from shared.model_worker import bind_cpus_or_exit, exit_unless_engine_fits

    exit_unless_engine_fits(settings.model, Role.ENCODER)  # refuse before loading anything
    bind_cpus_or_exit(settings.runtime)
    from services.encoder.handler import EncoderHandler

    # How many jobs it holds comes from the handler's admission (the engine's batch, or EPD_ENCODE_JOBS_IN_FLIGHT).
    run_worker(EncoderHandler(settings), settings)


if __name__ == "__main__":
    main()
