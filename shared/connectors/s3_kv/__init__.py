"""``S3KVConnector``: a vLLM KV connector that hands a prefilled request's KV cache from a
prefill instance to a decode instance through the project's store (any S3 server, or a folder;
E|P|D on vLLM).

Any vLLM 0.32 server can use it::

    --kv-transfer-config '{"kv_connector": "S3KVConnector",
                           "kv_connector_module_path": "shared.connectors.s3_kv",
                           "kv_role": "kv_producer",              # prefill; "kv_consumer": decode
                           "kv_connector_extra_config": {"s3_endpoint": "minio:9000", "s3_bucket": "epd"}}'

The hand-off goes through vLLM's ``kv_transfer_params`` (the same fields vLLM's P/D proxies pass
between instances):

* prefill request: ``{"do_remote_decode": true, "epd_kv_request": <id>, "epd_kv_attempt": <n>}``
  (both ``epd_kv_*`` optional: vLLM's request id and 0). When the prompt has been computed the
  connector writes every prompt token's K/V of every layer as one KV object and the finished
  request's ``kv_transfer_params`` say where: ``{"do_remote_prefill": true, "epd_kv_key": ...,
  "epd_kv_request": ..., "epd_kv_attempt": ..., "epd_kv_tokens": <prompt tokens>}``;
* decode request (same prompt, same images): exactly those params. The connector loads the object
  and vLLM computes only the last prompt token (whose logits give the first output token) and
  then decodes. Its finished output carries ``{"epd_kv_source": "store" | "recomputed:<reason>"}``.

Objects are KV objects of :mod:`shared.store.kv` (schema ``epd-kv-v1``, the same format code
and validation as everything else in the store): key ``<namespace>/kv/<model fingerprint>/
<request>-<attempt>``, where the model fingerprint covers every weight, the config, tokenizer,
template, dtype and engine of the folder vLLM loaded - a decode instance running other weights
never reads the object. Tensors: ``kv.<layer name>`` (every block of vLLM's paged cache that
holds a prompt token) and ``token_ids`` (I64); state: engine, block size, token count, per-layer
block shape (see :mod:`.layout`).

When the decode side decides (vLLM 0.32 scheduler, ``get_num_new_matched_tokens``): it answers
"not yet" (``None``) while a background thread fetches and validates the object (sha256, schema,
fingerprint, request and attempt, the token ids against the request's own prompt, layer names,
slot shapes and dtype against this engine's cache). Only validated tensors held in the scheduler
process are committed as external tokens; any miss or failed check answers 0 and vLLM prefills the
request itself - the request is prefilled again, never decoded on wrong state. The tensors ride to
the worker in the connector metadata and are written into the allocated blocks in
``start_load_kv``; a failure there (not expected after validation) is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those blocks (``kv_load_failure_policy``
"recompute", vLLM's default).

The producer writes synchronously in ``wait_for_save`` of the step that completes the prompt, so
when the prefill request's output arrives the object is stored (or the save failed: logged; the
decode side then finds no object and prefills again). Objects are deleted by their reader (the
epd-serve decode worker) and swept by age (``KVStore.sweep``).

The parameters are spelled once, in :mod:`shared.connectors.params` (``KVHandoffRequest``,
``KVHandoff``); the object layout is :mod:`.layout`. Layout of this package (as vLLM's own
role-routed connectors): :mod:`.connector` (the class vLLM loads, which builds the scheduler or
the worker side by role), :mod:`.scheduler`, :mod:`.worker`, :mod:`.state` (one record per
request), :mod:`.metadata` (what the sides send each other); configuration, store and
fingerprint come from :mod:`shared.connectors.common`.

The connector class imports vLLM and torch (loaded on first access); nothing imports it eagerly.
"""

from typing import Any

__all__ = ["S3KVConnector"]


def __getattr__(name: str) -> Any:
    # The connector class (vLLM, torch) loads when vLLM asks for it, so the torch-free parts
    # (state) import without them.
    if name == "S3KVConnector":
        from shared.connectors.s3_kv.connector import S3KVConnector

        return S3KVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
