"""OpenAI-compatible HTTP API: the HTTP mapping of chat requests onto the request protocol.

Per request:

1. parse and validate the body (``schemas``), authenticate (``EPD_API_KEYS``);
2. fetch / decode each image once (SSRF-guarded, bounded);
3. submit it (``ApiService.submit`` -> ``shared.client.RequestClient.submit``, the one
   implementation, shared with ``epd replay run``: each distinct image stored content-addressed, one
   ``EncodeJob`` per image whose EC object is not stored yet, the ``ChatRequestRecord``, the
   ``GenerationJob``);
4. forward tokens (SSE or one JSON body) until the final result, an error, or the deadline.

This module wires the HTTP side: the app (``asgi.EpdApp``, the generation routes in front of
FastAPI), its routes, one class per endpoint family as vLLM's ``serving_*`` classes
(``serving_generation``, ``serving_tokenization``, ``serving_models``, ``serving_debug``), and
typed ``shared.errors`` translated to OpenAI-shaped HTTP errors (``http_errors``, and only there).
Each part is handed what it needs of the settings, not the whole of them. What the process is made
of - connections, stores, the request client, the EC lifecycle, the delivery supervisor, start and
stop - is ``services.api.service``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from services.api.asgi import EpdApp
from services.api.conventions import HttpConventions, with_cors
from services.api.http_errors import install_error_handlers
from services.api.request_io import ApiKeys, RequestLimits
from services.api.served_model import ServedModel
from services.api.service import ApiService
from services.api.serving_debug import DebugRoutes
from services.api.serving_generation import GenerationRoutes
from services.api.serving_models import ModelRoutes
from services.api.serving_tokenization import TokenizationRoutes
from shared.config import ApiSettings
from shared.heap import freeze_startup_heap


def create_app(settings: ApiSettings, *, freeze_heap: bool = False) -> EpdApp:
    """The API app. ``freeze_heap``: freeze the process's heap once the service has started
    (``shared.heap``; the API process's own entry point, never an app built in a test's process)."""
    service = ApiService(settings)
    app = EpdApp(title="epd-serve", lifespan=_lifespan(service, freeze_heap=freeze_heap))
    app.state.service = service
    app.outermost = lambda inner: HttpConventions(
        with_cors(
            inner,
            origins=settings.allowed_origins,
            methods=settings.allowed_methods,
            headers=settings.allowed_headers,
            credentials=settings.allow_credentials,
        ),
        access_log_on=settings.access_log,
        route_of=app.route_of,
    )
    served = ServedModel.load(
        service.model_name,
        service.identity.model_path,
        settings.model,
        max_tokens_limit=settings.max_tokens_limit,
        generation_config=settings.generation_config,
    )
    keys = ApiKeys(settings.api_keys)
    limits = RequestLimits(
        max_body_bytes=settings.max_body_bytes,
        request_timeout_s=settings.request_timeout_s,
        max_images=settings.max_images_per_request,
        max_videos=settings.max_videos_per_request,
        default_max_tokens=settings.default_max_tokens,
    )
    install_error_handlers(app)
    ModelRoutes(service, served, keys, metrics_public=settings.metrics_public).register(app)
    DebugRoutes(service, keys).register(app)
    TokenizationRoutes(service, served, keys, limits).register(app)
    GenerationRoutes(service, served, keys, limits).register(app)
    return app


def _lifespan(service: ApiService, *, freeze_heap: bool) -> Any:
    """The app's lifespan: the service started before the first request, stopped after the last."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        if freeze_heap:
            freeze_startup_heap()
        try:
            yield
        finally:
            await service.stop()

    return lifespan
