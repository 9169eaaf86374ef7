"""The API's tokenizer, for ``/tokenize``, ``/detokenize`` and ``echo`` of a token-id prompt.

Loaded lazily from the model folder, on the first request that needs it (transformers - and with it
torch - is never imported at API start-up): transformers' ``AutoTokenizer`` and the folder's chat
template, the same template the engines render (``shared.engines.prompts.render_chat_prompt``,
``add_generation_prompt=True`` unless asked otherwise). Loading and tokenizing run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from shared.engines.prompts import normalize_messages
from shared.errors import EngineError, InvalidRequest

log = logging.getLogger(__name__)


class Tokenizer:
    """The model folder's tokenizer, loaded on first use (:meth:`get`)."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._tok: Any = None
        self._lock = asyncio.Lock()

    async def get(self) -> Any:
        async with self._lock:
            if self._tok is None:
                self._tok = await asyncio.to_thread(self._load)
        return self._tok

    def _load(self) -> Any:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.model_dir)
        except Exception as exc:  # any loading failure is the server's
            raise EngineError(f"the tokenizer of {self.model_dir} does not load: {exc}") from exc
        log.info("tokenizer loaded from %s (%s)", self.model_dir, type(tok).__name__)
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok) if self._tok is not None else 0

    async def encode_prompt(self, text: str, *, add_special_tokens: bool) -> list[int]:
        tok = await self.get()
        return await asyncio.to_thread(lambda: list(tok(text, add_special_tokens=add_special_tokens)["input_ids"]))

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (wire form, text parts only) and ``tools``
        (given to the template as the engines give them: ``render_chat_prompt``)."""
        tok = await self.get()
        extra: dict[str, Any] = {"tools": tools} if tools else {}

        def render() -> str:
            try:
                return tok.apply_chat_template(
                    normalize_messages(messages),
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **extra,
                )
            except Exception as exc:  # jinja2 errors (e.g. a template's raise_exception) land here
                raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc

        return await asyncio.to_thread(render)

    async def token_strs(self, ids: list[int]) -> list[str]:
        tok = await self.get()
        return list(await asyncio.to_thread(tok.convert_ids_to_tokens, ids))

    async def decode(self, ids: list[int] | tuple[int, ...], *, param: str = "tokens") -> str:
        tok = await self.get()
        bad = [t for t in ids if not 0 <= t < len(tok)]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{len(tok) - 1})", param=param)
        return await asyncio.to_thread(tok.decode, list(ids))
