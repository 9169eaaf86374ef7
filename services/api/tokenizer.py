"""The API's tokenizer, for ``/tokenize``, ``/detokenize`` and ``echo`` of a token-id prompt, and
its media counter, for the image and video parts of a ``/tokenize`` chat.

Loaded lazily from the model folder, on the first request that needs it (transformers - and with it
torch - is never imported at API start-up): transformers' ``AutoTokenizer`` and the folder's chat
template, the same template the engines render (``shared.engines.prompts.render_chat_prompt``,
``add_generation_prompt=True`` unless asked otherwise). Loading and tokenizing run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.engines.base import VideoFrames
from shared.engines.prompts import check_placeholder_tokens, normalize_messages
from shared.errors import EngineError, InvalidRequest, UnsupportedContent
from shared.families import model_type_of
from shared.media import LoadedImage
from shared.protocol import MediaKind
from shared.video import SampledVideo

if TYPE_CHECKING:
    from shared.engines.families.base import VisionFamily

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


class MediaCounter:
    """The prompt side of the model's family (``shared.engines.families``: its processor and
    ``config.json``, no weights), loaded on first use: a ``/tokenize`` chat's image and video parts
    become the placeholder tokens the engine puts in the prompt for them - each item through the
    family's own processor call (:meth:`VisionFamily.video_pixels` / :meth:`~VisionFamily.image_pixels`,
    the calls the transformers engine encodes from), counted by the family
    (:meth:`VisionFamily.prompt_item`) and expanded by it (:meth:`VisionFamily.expand`, the engine's
    expansion). The vLLM engine expands with the same HF processor, so the count is its too."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self._family: VisionFamily | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> VisionFamily:
        async with self._lock:
            if self._family is None:
                self._family = await asyncio.to_thread(self._load)
        return self._family

    def _load(self) -> VisionFamily:
        from transformers import AutoConfig, AutoProcessor

        from shared.engines.families import TRANSFORMERS_FAMILIES, family_class

        model_type = model_type_of(self.model_dir)
        if model_type not in TRANSFORMERS_FAMILIES:
            raise EngineError(f"no family module for model_type {model_type!r}: its media cannot be counted")
        try:
            config = AutoConfig.from_pretrained(self.model_dir)
            processor = AutoProcessor.from_pretrained(self.model_dir)
        except Exception as exc:  # any loading failure is the server's
            raise EngineError(f"the processor of {self.model_dir} does not load: {exc}") from exc
        # (the prompt side only: no model - the methods used here never touch it)
        return family_class(model_type)(None, config, processor)

    async def expand(
        self, text: str, ids: list[int], media: Sequence[LoadedImage | SampledVideo], *, add_special_tokens: bool
    ) -> list[int]:
        """``ids`` (``text`` tokenized) with each media placeholder expanded to its item's tokens,
        ``media`` in placeholder order (as the API loads them for a chat request). A 400 when a
        text part holds a placeholder token itself (as the engine refuses it), or when the family
        cannot know an item's count before encoding it (InternVL's tiles)."""
        family = await self.get()

        def run() -> list[int]:
            kinds = [str(MediaKind.VIDEO if isinstance(m, SampledVideo) else MediaKind.IMAGE) for m in media]
            for kind, token in family.placeholders().items():
                check_placeholder_tokens(ids, token, kinds.count(kind), kind)
            items = []
            for m in media:
                video = None
                if isinstance(m, SampledVideo):
                    video = VideoFrames.of(m)  # (its frames' metadata: Qwen3-VL writes their times in the prompt)
                    kind, pixels = MediaKind.VIDEO, family.video_pixels(m.frames)
                else:
                    kind, pixels = MediaKind.IMAGE, family.image_pixels(m.to_rgb())
                item = family.prompt_item(kind, pixels, video)
                if item is None:
                    raise UnsupportedContent(
                        f"this model's {kind} parts cannot be counted before they are encoded "
                        f"({type(family).__name__}): tokenize the text without them",
                        param="messages",
                    )
                items.append(item)
            return family.expand(text, ids, items, add_special_tokens)

        return await asyncio.to_thread(run)
