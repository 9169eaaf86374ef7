"""The start-up heap of a long-running service process, kept out of the garbage collector's way.

A worker imports torch, transformers and vLLM and loads its engine; the API imports FastAPI,
pydantic and the tokenizer: ~460-490k objects that live as long as the process. CPython's full
collection scans every tracked object, and it runs whenever the objects that survived into the
oldest generation since the last one reach a quarter of it, which a burst of requests does: a
~200 ms pause on this kind of machine, taken by whichever request is in flight (a text-only probe
of ~105 ms answered in 480-750 ms right after a burst, P4). So once a service has started, its heap
is collected once and frozen (``gc.freeze``: moved to a permanent generation the collector never
scans), as vLLM's engine core does after loading; what requests allocate is collected as before.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive now. Call it once start-up is done (the engine
    loaded), in the service's own process: the objects it freezes are never collected. Returns how
    many objects are frozen."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "start-up heap frozen: %d objects kept out of the collector (%.0f ms)",
        frozen,
        (time.perf_counter() - started) * 1e3,
    )
    return frozen
