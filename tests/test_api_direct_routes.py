"""``services.api.asgi.EpdApp``: the generation routes served in front of FastAPI's router."""

from __future__ import annotations

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.testclient import TestClient

from services.api.asgi import EpdApp


class Refused(Exception):
    pass


def _app() -> tuple[EpdApp, list[str]]:
    app = EpdApp()
    served: list[str] = []

    async def direct(request: Request) -> Response:
        body = await request.json()
        served.append(request.url.path)
        if body.get("refuse"):
            raise Refused("no")
        if body.get("crash"):
            raise KeyError("crash")
        return JSONResponse({"echo": body})

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        return PlainTextResponse(f"refused: {exc}", status_code=418)

    @app.get("/v1/things")
    async def things() -> Response:
        return PlainTextResponse("listed")

    app.direct_post("/v1/things", direct)  # (only here: FastAPI's router has no POST for it)
    return app, served


def test_a_direct_route_serves_its_posts_and_leaves_the_rest_to_fastapi() -> None:
    app, served = _app()
    with TestClient(app) as client:
        r = client.post("/v1/things", json={"a": 1})
        assert (r.status_code, r.json()) == (200, {"echo": {"a": 1}})
        assert served == ["/v1/things"]
        # other methods, other paths: FastAPI's (a GET route; no POST route anywhere else)
        assert client.get("/v1/things").text == "listed"
        assert client.post("/v1/things/", json={}, follow_redirects=False).status_code == 307  # FastAPI's redirect
        assert client.post("/v1/other", json={}).status_code == 404
        assert served == ["/v1/things"]


def test_a_direct_routes_exceptions_go_to_the_apps_handlers() -> None:
    app, _ = _app()
    with TestClient(app, raise_server_exceptions=True) as client:
        r = client.post("/v1/things", json={"refuse": True})
        assert (r.status_code, r.text) == (418, "refused: no")
        with pytest.raises(KeyError):  # no handler for it: raised, as Starlette would
            client.post("/v1/things", json={"crash": True})


def test_under_a_root_path_fastapi_routes_every_request() -> None:
    app, served = _app()
    with TestClient(app, root_path="/prefix") as client:
        assert client.post("/v1/things", json={"a": 1}).status_code in (404, 405)
    assert served == []


def test_direct_routes_are_set_before_the_first_request() -> None:
    app, _ = _app()
    with TestClient(app) as client:
        client.get("/v1/things")
        with pytest.raises(RuntimeError, match="before the app serves"):
            app.direct_post("/v1/late", lambda request: None)  # type: ignore[arg-type,return-value]  # never called
