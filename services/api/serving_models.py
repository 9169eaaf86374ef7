"""The routes about the server and its model: ``/v1/models`` (vLLM's model card), ``/version``,
``/health``, ``/ping`` (vLLM's liveness probe) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.api.request_io import ApiKeys
from services.api.schemas import check_model
from services.api.served_model import ServedModel
from services.api.service import ApiService
from shared.errors import ServiceUnavailable


class ModelRoutes:
    """``metrics_public``: ``/metrics`` answers without a key although keys are set (``EPD_METRICS_PUBLIC``)."""

    def __init__(self, service: ApiService, served: ServedModel, keys: ApiKeys, *, metrics_public: bool):
        self.service = service
        self.served = served
        self.keys = keys
        self.metrics_public = metrics_public

    def register(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/ping")(self.ping)
        app.post("/ping")(self.ping)
        app.get("/metrics")(self.prometheus_metrics)
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{model_id:path}")(self.get_model)
        app.get("/version")(self.version)

    async def health(self):
        service = self.service
        live = service.workers.live()
        connected = await service.nats_answers()
        body = {
            "status": "ok" if connected else "unavailable",
            "nats": connected,
            "model": service.model_name,
            "encoder_fingerprint": service.fingerprint,
            "workers": {role: len(hbs) for role, hbs in live.items()},
        }
        return JSONResponse(body, status_code=200 if connected else 503)

    async def ping(self):
        """vLLM's (and SageMaker's) liveness probe: an empty 200 while NATS answers, else 503."""
        if not await self.service.nats_answers():
            raise ServiceUnavailable("NATS does not answer")
        return Response(status_code=200)

    async def prometheus_metrics(self, request: Request):
        if not self.metrics_public:
            self.keys.check(request)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def model_card(self) -> dict[str, Any]:
        # root / parent as vLLM answers them: its `bench serve` reads root when --model is left out.
        return {
            "id": self.served.name,
            "object": "model",
            "created": self.served.created,
            "owned_by": "epd-serve",
            "root": self.served.name,
            "parent": None,
            "max_model_len": self.served.context_len,
        }

    async def list_models(self, request: Request):
        self.keys.check(request)
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, request: Request, model_id: str):
        self.keys.check(request)
        check_model(model_id, self.served.name)
        return self.model_card()

    async def version(self):
        try:
            return {"version": importlib.metadata.version("epd-serve")}
        except importlib.metadata.PackageNotFoundError:
            return {"version": "unknown"}
