"""Test-side fault injection for worker processes: ``python -m tests.fault_workers <service>``
runs ``services.<service>`` with its engine slowed down as the environment asks:

* ``EPD_TEST_ENCODE_DELAY_S`` (encoder; prefill, for its engine's encodes: a steal, a local
  recompute): sleep this long before each encode, logging ``fault injection: ...`` first (a test
  waits for that line to know the worker holds a job);
* ``EPD_TEST_DECODE_STEP_DELAY_S`` (decode or prefill, transformers engine): each batched decode step
  sleeps this long after stepping (numerics unchanged), so a test can act while requests are
  being decoded, or let a deadline pass mid-decode;
* ``EPD_TEST_DECODE_STEP_BUSY_S`` (the same workers): each batched decode step computes this long
  more (torch matrix products in the engine's compute thread, as the step's own compute), so a
  job's compute lasts longer than the ack wait (tests/test_failover.py).

Production settings have no fault knobs; tests start such a worker with
``Stack(service_modules={"decode": "tests.fault_workers"})`` (``tests.stackutil.start_stack``
takes ``service_modules`` too).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

ENCODE_DELAY_ENV = "EPD_TEST_ENCODE_DELAY_S"
DECODE_STEP_DELAY_ENV = "EPD_TEST_DECODE_STEP_DELAY_S"
DECODE_STEP_BUSY_ENV = "EPD_TEST_DECODE_STEP_BUSY_S"
#: Start a service through this module (``Stack.service_modules``).
MODULE = __name__


def _delay(name: str) -> float:
    return float(os.environ.get(name) or 0)


def slow_encoder(engine_cls: type, delay_s: float) -> None:
    """Every encode of ``engine_cls`` (``encode`` or ``produce``, whichever it has) first sleeps."""
    from shared.engines.base import FeaturesThroughConnector, FeaturesThroughWorker

    for mixin, method in ((FeaturesThroughWorker, "encode"), (FeaturesThroughConnector, "produce")):
        if not issubclass(engine_cls, mixin):
            continue
        original = getattr(engine_cls, method)

        async def slow(self, images, _original=original, _method=method):
            log.warning("fault injection: sleeping %.1fs before %s of %d image(s)", delay_s, _method, len(images))
            await asyncio.sleep(delay_s)
            return await _original(self, images)

        setattr(engine_cls, method, slow)


def slow_decode_steps(delay_s: float) -> None:
    """Every batched decode step of the transformers engine sleeps ``delay_s`` after stepping
    (in the engine's compute thread, like the step itself)."""
    from shared.engines.transformers_batch import BatchDecoder

    original = BatchDecoder.step

    def step(self):
        events = original(self)
        time.sleep(delay_s)
        return events

    BatchDecoder.step = step
    log.warning("fault injection: the engine sleeps %.2fs after each decode step", delay_s)


def busy_decode_steps(busy_s: float) -> None:
    """Every batched decode step of the transformers engine computes ``busy_s`` more after stepping:
    torch matrix products (the GIL released in each, as in a forward) in the engine's compute thread."""
    import torch

    from shared.engines.transformers_batch import BatchDecoder

    original = BatchDecoder.step
    a = torch.rand(256, 256)

    def step(self):
        events = original(self)
        until = time.perf_counter() + busy_s
        while time.perf_counter() < until:
            a @ a
        return events

    BatchDecoder.step = step
    log.warning("fault injection: the engine computes %.2fs more after each decode step", busy_s)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.fault_workers encoder|prefill|decode")
    service = argv[0]
    from shared.config import ModelSettings
    from shared.engines import engine_class

    engine_cls = engine_class(ModelSettings().engine)
    if service in ("encoder", "prefill") and _delay(ENCODE_DELAY_ENV):
        slow_encoder(engine_cls, _delay(ENCODE_DELAY_ENV))
    if service in ("decode", "prefill") and _delay(DECODE_STEP_DELAY_ENV):
        slow_decode_steps(_delay(DECODE_STEP_DELAY_ENV))
    if service in ("decode", "prefill") and _delay(DECODE_STEP_BUSY_ENV):
        busy_decode_steps(_delay(DECODE_STEP_BUSY_ENV))
    importlib.import_module(f"services.{service}.main").main()


if __name__ == "__main__":
    main(sys.argv[1:])
