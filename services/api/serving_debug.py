"""The debug pages' routes: ``/debug/requests`` (the recent requests) and
``/debug/requests/{request_id}`` (a request's waterfall), read back from the streams; HTML or
``?format=json``. They need an API key when keys are set."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from services.api.debug_pages import requests_index_html
from services.api.request_io import ApiKeys
from services.api.service import ApiService
from shared import history, timeline
from shared.errors import InvalidRequest, ServiceUnavailable


class DebugRoutes:
    def __init__(self, service: ApiService, keys: ApiKeys):
        self.service = service
        self.keys = keys

    def register(self, app: FastAPI) -> None:
        app.get("/debug/requests")(self.debug_requests)
        app.get("/debug/requests/{request_id}")(self.debug_request)

    async def debug_requests(
        self,
        request: Request,
        format: str = "html",
        status: str | None = None,
        since_s: float = 3600.0,
        limit: int = 50,
    ):
        """Recent requests, newest first, with their status, each linking its waterfall page
        (``?format=json``: the list; ``status``: ok, error, cancelled or incomplete)."""
        self.keys.check(request)
        if status and status not in history.STATUSES:
            raise InvalidRequest(f"unknown status {status!r}: use {', '.join(history.STATUSES)}", param="status")
        service = self.service
        if service.nc is None or not service.nc.is_connected:
            raise ServiceUnavailable("not connected to NATS")
        summaries = await history.list_requests(
            service.nc, service.subjects, since_s=since_s, status=status or None, limit=limit
        )
        if format == "json":
            return JSONResponse({"requests": [s.to_json() for s in summaries]})
        return HTMLResponse(requests_index_html(summaries, status=status, since_s=since_s))

    async def debug_request(self, request: Request, request_id: str, format: str = "html"):
        """The request's waterfall page (``?format=json``: its messages and timeline as JSON)."""
        self.keys.check(request)
        service = self.service
        if service.nc is None or not service.nc.is_connected:
            raise ServiceUnavailable("not connected to NATS")
        case = await history.find_case(service.nc, service.subjects, request_id)
        tl = timeline.build_timeline(case)
        if format == "json":
            return JSONResponse({"case": case.to_json(), "timeline": tl.to_json()})
        # (relative: right behind a proxy's path prefix too)
        return HTMLResponse(timeline.render_html(case, tl, index_href="../requests"))
