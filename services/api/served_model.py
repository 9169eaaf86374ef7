"""What the API serves of its model, decided once at start-up from the model folder: the context
length and what sets it, the ``max_tokens`` bound, the model card's ``created``, the tool-call
parser, the sampling defaults, and the tokenizer and media counter (loaded on first use)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from services.api.sampling_defaults import SamplingDefaults, load_sampling_defaults
from services.api.schemas import check_sampling_defaults
from services.api.tokenizer import MediaCounter, Tokenizer
from services.api.tool_parsers import ToolParser, parser_for_model
from shared import metrics
from shared.config import ModelSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    #: the model's name in requests and responses
    name: str
    #: the context served (EPD_MAX_MODEL_LEN, which both engines honour, or the model's) and what sets it
    context_len: int
    context_source: str
    #: the largest ``max_tokens`` a request may ask for, and what sets it (named in the 400). Prompt +
    #: max_tokens over the context is refused by the worker that tokenized the prompt (a 400 naming
    #: the same limit).
    max_tokens_limit: int
    max_tokens_source: str
    #: ``created`` of the model card: when the model folder's config.json was written (the same on
    #: every API replica and across restarts, unlike the API's start time)
    created: int
    #: tool_choice "auto" and tool conversations: decided once, from the chat template the workers
    #: render (a template that renders tools and asks for a call format parsed here); None: off
    tool_parser: ToolParser | None
    #: what a request that leaves a sampling field out gets: the model's generation config, as on
    #: vLLM's server (EPD_GENERATION_CONFIG), checked once (a bad default stops the start-up)
    sampling_defaults: SamplingDefaults
    #: /tokenize, /detokenize, echo of a token-id prompt (loaded on first use)
    tokenizer: Tokenizer
    #: /tokenize of a chat with images or videos: their placeholder tokens (loaded on first use)
    media_counter: MediaCounter

    @classmethod
    def load(
        cls,
        name: str,
        model_path: Path,
        model: ModelSettings,
        *,
        max_tokens_limit: int | None,
        generation_config: str,
    ) -> ServedModel:
        """The served model ``name`` of the folder ``model_path`` (``model``: its settings group;
        ``max_tokens_limit``: ``EPD_MAX_TOKENS_LIMIT``; ``generation_config``: ``EPD_GENERATION_CONFIG``)."""
        tokenizer, media_counter = Tokenizer(model_path), MediaCounter(model_path)
        context_len, context_source = context_length(model_path, model.max_model_len)
        if max_tokens_limit is not None and max_tokens_limit < context_len:
            limit, limit_source = max_tokens_limit, "EPD_MAX_TOKENS_LIMIT"
        else:
            limit, limit_source = context_len, context_source
        tool_parser = parser_for_model(model_path)
        log.info(
            "tool calling (tool_choice auto): %s",
            f"the {tool_parser.name} parser" if tool_parser else "off (the chat template renders no tool calls)",
        )
        sampling_defaults = load_sampling_defaults(model_path, generation_config)
        check_sampling_defaults(sampling_defaults)
        log.info("sampling defaults: %s from %s", sampling_defaults.given() or "OpenAI's", sampling_defaults.source)
        return cls(
            name=name,
            context_len=context_len,
            context_source=context_source,
            max_tokens_limit=limit,
            max_tokens_source=limit_source,
            created=_mtime(model_path / "config.json"),
            tool_parser=tool_parser,
            sampling_defaults=sampling_defaults,
            tokenizer=tokenizer,
            media_counter=media_counter,
        )


def context_length(model_dir: Path, max_model_len: int | None) -> tuple[int, str]:
    """The context length served and what sets it: ``EPD_MAX_MODEL_LEN`` when it is below the
    model's ``max_position_embeddings`` (it can only lower it, as the engines apply it), else the
    model's."""
    model_len = metrics.model_max_len(model_dir)
    if max_model_len and max_model_len < model_len:
        return max_model_len, "the context length set by EPD_MAX_MODEL_LEN (epd up --max-model-len)"
    return model_len, (
        "the model's context length (max_position_embeddings in its config.json; EPD_MAX_MODEL_LEN lowers it)"
    )


def _mtime(path: Path) -> int:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return int(time.time())
