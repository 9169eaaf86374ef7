"""Decode worker process: ``python -m services.decode`` (or ``epd decode``)."""

from __future__ import annotations

from shared.config import DecodeSettings
from shared.logs import setup_logging
from shared.worker import run_worker


def main() -> None:
    settings = DecodeSettings()
    setup_logging(settings.log_level, service="decode", fmt=settings.log_format)
    from shared.encoding import require_kv_handoff_engine
    from shared.errors import EngineError

    try:  # refuse before loading anything
        require_kv_handoff_engine(settings.engine, "decode")
    except EngineError as exc:
        raise SystemExit(f"decode worker: {exc}") from None
    from services.decode.handler import DecodeHandler

    # One fetch can take a whole batch; every job in flight is one row of the batch.
    run_worker(DecodeHandler(settings), settings, batch_size=settings.max_batch_size,
               concurrency=settings.max_batch_size)


if __name__ == "__main__":
    main()
