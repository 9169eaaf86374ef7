"""Prefill worker process: ``python -m services.prefill`` (or ``epd prefill``)."""

from __future__ import annotations

from shared.config import PrefillSettings
from shared.logs import setup_logging
from shared.worker import run_worker


def main() -> None:
    settings = PrefillSettings()
    role = settings.role
    setup_logging(settings.log_level, service=f"prefill-{role}", fmt=settings.log_format)
    from shared.model_worker import exit_unless_engine_fits

    exit_unless_engine_fits(settings, role)  # refuse before loading anything
    from services.prefill.handler import PrefillHandler

    run_worker(PrefillHandler(settings), settings, batch_size=1, concurrency=settings.max_concurrent_jobs)


if __name__ == "__main__":
    main()
