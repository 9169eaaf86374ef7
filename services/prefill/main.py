"""Prefill worker process: ``python -m services.prefill`` (or ``epd prefill``)."""

from __future__ import annotations

from shared.config import PrefillSettings
from shared.logs import setup_logging
from shared.worker import run_worker


def main() -> None:
    settings = PrefillSettings()
    setup_logging(settings.log_level, service=f"prefill-{settings.role}", fmt=settings.log_format)
    if settings.role == "prefill":
        from shared.encoding import require_kv_handoff_engine
        from shared.errors import EngineError

        try:  # refuse before loading anything
            require_kv_handoff_engine(settings.engine, settings.role)
        except EngineError as exc:
            raise SystemExit(f"prefill worker: {exc}") from None
    from services.prefill.handler import PrefillHandler

    run_worker(PrefillHandler(settings), settings, batch_size=1, concurrency=settings.max_concurrent_jobs)


if __name__ == "__main__":
    main()
