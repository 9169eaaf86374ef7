"""Prefill worker process: ``python -m services.prefill`` (or ``epd prefill``)."""

from __future__ import annotations

from shared.config import PrefillSettings
from shared.logs import setup_logging
from shared.worker import run_worker


def main() -> None:
    settings = PrefillSettings()
    role = settings.role
    setup_logging(settings.log_level, service=f"prefill-{role}", fmt=settings.log_format)
    from shared.model_worker import bind_cpus_or_exit, exit_unless_engine_fits

    exit_unless_engine_fits(settings.model, role)  # refuse before loading anything
    bind_cpus_or_exit(settings.runtime)
    from services.prefill.handler import PrefillHandler

    # How many jobs it holds comes from the handler's admission (engine slots + jobs waiting for features).
    run_worker(PrefillHandler(settings), settings)


if __name__ == "__main__":
    main()
