"""``S3ECConnector``: a vLLM EC connector over the project's EC store (any S3 server, or a folder).

Any vLLM 0.32 server can use it, with no epd-serve service running::

    --ec-transfer-config '{"ec_connector": "S3ECConnector",
                           "ec_connector_module_path": "shared.connectors.s3_ec",
                           "ec_role": "ec_producer",            # or "ec_consumer"
                           "ec_connector_extra_config": {"s3_endpoint": "minio:9000", "s3_bucket": "epd"}}'

Objects are written and read through :class:`shared.store.ec.ECStore`: the same key scheme
(``<namespace>/<encoder fingerprint>/<identifier>``), object format and validation as every other
component. The identifier is vLLM's ``mm_hash`` of the item; epd-serve's workers pass the image's
content hash as the multimodal uuid so that it equals the project's item hash. vLLM's mm_hash does
not know the model version, so the key's version part is the encoder fingerprint computed from the
model folder vLLM actually loaded (``vllm_config.model_config.model``) and its dtype: a store
shared by two model versions never serves one's outputs to the other.

How vLLM 0.32's scheduler drives a connector (read from ``vllm/v1/core/sched/scheduler.py``), and
what this one does at each point:

1. ``ensure_cache_available(request, num_computed_tokens)`` is called for every request with
   multimodal items *before* its encoder inputs are considered, each time the scheduler looks at
   it (waiting and running). ``False`` skips the request for this step. Here: for each item not yet
   covered by computed tokens, the connector starts a background prefetch (existence check with a
   short-lived cache, GET, full validation, shape check against the request's placeholder) and
   defers the request until the prefetch has *decided*: bytes validated and held locally, or a
   miss / failure, in which case the item is encoded locally. The engine step never waits on the
   network.
2. ``has_cache_item(identifier)`` is called in ``_try_schedule_encoder_inputs`` for an item that is
   not in vLLM's own encoder cache. ``True`` commits the item as an external load *in this very
   step*: the worker must put the tensor into the encoder cache before ``_gather_mm_embeddings``
   of the same step. So it answers from local state only: True iff validated bytes are held.
3. ``update_state_after_alloc`` (same pass) -> ``build_connector_meta`` ships the held bytes to the
   worker, whose ``start_load_caches`` turns them into the encoder-cache tensor (no network).
4. ``take_unavailable_requests()`` is drained in ``update_from_output``; vLLM *fails* those
   requests (``FINISHED_ERROR``, "re-issuing the request re-runs the encode"). There is no way
   back once an item is committed, so a fetch or validation failure is never reported there: the
   prefetch decides before the commit and the request falls back to local encoding (its pixels
   are in the request). Only a request that carries no local input for an unobtainable item (not
   the case for epd-serve or plain image requests) is reported as unavailable.

Producer side: ``save_caches`` writes each encoder output right after it is computed (in the
worker's step, synchronously: a dedicated encoder instance has nothing else to do, and the
request only finishes after the step, so a finished producer request means the object is stored).
``start_save_caches`` re-saves items a repeated request found already in vLLM's encoder cache
when their object is gone from the store.

Counters (hits, misses, fallbacks by reason, bytes, fetch/save latency) travel as vLLM
``ECConnectorStats`` to the front-end process: logged as "EC Transfer metrics" and exported to
Prometheus as ``epd:ec_connector_*`` by :meth:`S3ECConnector.build_prom_metrics`. Worker-side
counters of a consumer ride back on ``ECConnectorWorkerMetadata``; a producer's cannot: in vLLM
0.32's V1 model runner the encoder-only path returns an output without the EC connector part, so
each save is logged instead (the epd-serve encoder worker counts its own encodes).

Layout (as vLLM's own role-routed connectors): :mod:`.connector` (the class vLLM loads, which
builds the scheduler or the worker side by role), :mod:`.scheduler`, :mod:`.worker`,
:mod:`.state` (one record per request item and per stored object, the lookup outcomes),
:mod:`.metadata` (what the sides send each other), :mod:`.metrics`; configuration, store and
fingerprint come from :mod:`shared.connectors.common`.

The connector class imports vLLM and torch (loaded on first access); nothing imports it eagerly.
"""

from typing import Any

__all__ = ["S3ECConnector"]


def __getattr__(name: str) -> Any:
    # The connector class (vLLM, torch) loads when vLLM asks for it, so the torch-free parts
    # (state) import without them.
    if name == "S3ECConnector":
        from shared.connectors.s3_ec.connector import S3ECConnector

        return S3ECConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
