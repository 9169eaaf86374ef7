"""Typed views of what passes between our vLLM engine and our connectors inside vLLM.

vLLM carries per-request connector data as plain dicts (``kv_transfer_params`` in and out of a
request, ``ec_transfer_params`` out of a finished one). Every key we use is spelled here once;
the engine and the connectors convert through these types and never write the literals.
No vLLM or torch import: the engine, the connectors and the tests share this module.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# kv_transfer_params keys (vLLM's own and ours)
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
KV_KEY = "epd_kv_key"
KV_REQUEST = "epd_kv_request"
KV_ATTEMPT = "epd_kv_attempt"
KV_TOKENS = "epd_kv_tokens"
KV_SOURCE = "epd_kv_source"
# ec_transfer_params keys (ours)
EC_SOURCES = "epd_ec_sources"
EC_ITEMS = "epd_ec_items"


class Source(str, enum.Enum):
    """Where a request's encoder output (``EC_SOURCES`` values) or KV cache (``KV_SOURCE``)
    came from. On the wire: ``store``, ``engine_cache`` or ``recomputed:<reason>``."""

    STORE = "store"
    #: EC only: vLLM still held the item (encoder or prefix cache); the connector was not asked
    ENGINE_CACHE = "engine_cache"
    #: computed again by the engine, for a reason (a ``MissReason`` value)
    RECOMPUTED = "recomputed"

    def report(self, reason: str = "") -> str:
        """The wire value (``recomputed:<reason>`` for RECOMPUTED)."""
        return f"{self.value}:{reason}" if self is Source.RECOMPUTED else self.value


class MalformedParams(ValueError):
    """Connector params that do not have the fields or types this module expects."""


@dataclass(frozen=True)
class KVHandoffRequest:
    """Prefill side: compute the prompt and store its KV cache as the KV object of
    (``request``, ``attempt``) for a decode engine."""

    request: str
    attempt: int = 0

    def to_params(self) -> dict[str, Any]:
        return {DO_REMOTE_DECODE: True, KV_REQUEST: self.request, KV_ATTEMPT: self.attempt}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None, *, default_request: str) -> KVHandoffRequest | None:
        """The request's hand-off ask, or None when it does not ask for one."""
        params = params or {}
        if not params.get(DO_REMOTE_DECODE):
            return None
        request = params.get(KV_REQUEST, default_request)
        attempt = params.get(KV_ATTEMPT, 0)
        if not isinstance(request, str) or not request or not isinstance(attempt, int) or attempt < 0:
            raise MalformedParams(f"malformed kv_transfer_params {dict(params)!r}")
        return cls(request, attempt)


@dataclass(frozen=True)
class KVHandoff:
    """Where a prefilled request's KV cache is: what the prefill engine reports and what the
    decode engine loads (``prompt_tokens``: the prompt length the object holds, 0 = unknown)."""

    key: str
    request: str
    attempt: int = 0
    prompt_tokens: int = 0

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            DO_REMOTE_PREFILL: True,
            KV_KEY: self.key,
            KV_REQUEST: self.request,
            KV_ATTEMPT: self.attempt,
        }
        if self.prompt_tokens:
            params[KV_TOKENS] = self.prompt_tokens
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> KVHandoff | None:
        """The hand-off the params describe, or None when they describe none."""
        params = params or {}
        if not params.get(DO_REMOTE_PREFILL) or KV_KEY not in params:
            return None
        key, request = params.get(KV_KEY), params.get(KV_REQUEST)
        attempt, tokens = params.get(KV_ATTEMPT, 0), params.get(KV_TOKENS, 0)
        if not (
            isinstance(key, str)
            and key
            and isinstance(request, str)
            and request
            and isinstance(attempt, int)
            and attempt >= 0
            and isinstance(tokens, int)
            and tokens >= 0
        ):
            raise MalformedParams(f"malformed kv_transfer_params {dict(params)!r}")
        return cls(key, request, attempt, tokens)


def kv_source_of(params: Mapping[str, Any] | None) -> str:
    """Where a decode engine's KV cache came from (``store`` / ``recomputed:<reason>``)."""
    return str((params or {}).get(KV_SOURCE, "recomputed:unknown"))


def ec_sources_of(params: Mapping[str, Any] | None) -> dict[str, str]:
    """Per item hash, where a finished request's encoder outputs came from."""
    return {str(k): str(v) for k, v in ((params or {}).get(EC_SOURCES) or {}).items()}


def ec_items_of(params: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per item hash, what an EC producer stored (``{"n_tokens": ...}``)."""
    return dict((params or {}).get(EC_ITEMS) or {})
