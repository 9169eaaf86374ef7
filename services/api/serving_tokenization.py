"""vLLM's ``/tokenize`` and ``/detokenize``, on the served model's tokenizer (and, for a chat's
images and videos, its media counter)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from services.api.request_io import ApiKeys, RequestLimits, read_body
from services.api.schemas import parse_detokenize_request, parse_json_body, parse_tokenize_request
from services.api.served_model import ServedModel
from services.api.service import ApiService
from shared.errors import DeadlineExceeded


class TokenizationRoutes:
    def __init__(self, service: ApiService, served: ServedModel, keys: ApiKeys, limits: RequestLimits):
        self.service = service
        self.served = served
        self.keys = keys
        self.limits = limits

    def register(self, app: FastAPI) -> None:
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)

    async def tokenize(self, request: Request):
        """vLLM's ``/tokenize``: a ``prompt`` or chat ``messages`` -> token ids. A chat's image and
        video parts are loaded as a chat request's (``media_io_kwargs`` included) and stand as the
        placeholder tokens the engine expands them to (``MediaCounter``): ``count`` is the chat's
        ``usage.prompt_tokens``."""
        self.keys.check(request)
        served, limits, tokenizer = self.served, self.limits, self.served.tokenizer
        req = parse_tokenize_request(
            parse_json_body(await read_body(request, limits.max_body_bytes)),
            served_model=served.name,
            tool_parser=served.tool_parser,
            max_images=limits.max_images,
            max_videos=limits.max_videos,
        )
        if req.messages is not None:
            text = await tokenizer.render_chat(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
            )
        else:
            assert req.prompt is not None
            text = req.prompt
        tokens = await tokenizer.encode_prompt(text, add_special_tokens=req.add_special_tokens)
        if req.media:
            try:
                media = await asyncio.wait_for(
                    self.service.load_media(req.media, req.video_sampling), timeout=limits.request_timeout_s
                )
            except TimeoutError:
                raise DeadlineExceeded("the request passed its deadline while loading its media") from None
            tokens = await served.media_counter.expand(text, tokens, media, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(tokens), "max_model_len": served.context_len, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = await tokenizer.token_strs(tokens)
        return body

    async def detokenize(self, request: Request):
        """vLLM's ``/detokenize``: token ids -> ``{"prompt": text}``."""
        self.keys.check(request)
        tokens = parse_detokenize_request(
            parse_json_body(await read_body(request, self.limits.max_body_bytes)), served_model=self.served.name
        )
        return {"prompt": await self.served.tokenizer.decode(tokens)}
