"""Bad input gets its status code and an OpenAI-shaped error; the services keep serving."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import re
import socket
import threading
import time

import httpx
import pytest
from PIL import Image

from shared.history import list_requests
from shared.protocol import ChatRequestRecord, ErrorEvent
from shared.topology import Service
from tests.stackutil import GREEDY as _GREEDY
from tests.stackutil import data_url, noise_image, png_bytes, user_message, wait_for

pytestmark = pytest.mark.slow

GREEDY = {**_GREEDY, "max_tokens": 4}
#: A request that no worker answers must end at its deadline; one that takes this long hangs.
HANG_S = 60


@pytest.fixture(scope="module")
def image_server():
    """A loopback HTTP server with one PNG at /ok.png and a 404 elsewhere."""
    png = png_bytes(noise_image(61, (56, 56)))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/to-data":  # a redirect off the web, to a data: URL
                self.send_response(302)
                self.send_header("Location", "data:image/png;base64," + base64.b64encode(png).decode())
                self.end_headers()
            elif self.path.split("?")[0] == "/ok.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post_raw(stack, content: bytes, headers=None):
    return httpx.post(
        f"{stack.url}/v1/chat/completions",
        content=content,
        timeout=60,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


def _image_msg(url):
    return [user_message("Describe.", [url])]


def _assert_error(resp, status, code):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["code"] == code, err


def test_bad_inputs_get_clear_errors_and_the_service_keeps_serving(epd_stack, image_server):
    tiny_png = png_bytes(noise_image(62, (8, 8)))
    big = Image.new("RGB", (600, 600))
    buf = io.BytesIO()
    big.save(buf, format="BMP")  # ~1 MB, over the stack's EPD_MAX_IMAGE_BYTES (512 KiB)
    too_large_url = "data:image/bmp;base64," + base64.b64encode(buf.getvalue()).decode()

    cases = [
        ("invalid json", lambda: _post_raw(epd_stack, b"{not json"), 400, "invalid_request"),
        ("no messages", lambda: epd_stack.chat([], **GREEDY), 400, "invalid_request"),
        (
            "unsupported part",
            lambda: epd_stack.chat(
                [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], **GREEDY
            ),
            400,
            "unsupported_content",
        ),
        (
            "undecodable image",
            lambda: epd_stack.chat(
                _image_msg("data:image/png;base64," + base64.b64encode(b"not an image at all").decode()), **GREEDY
            ),
            400,
            "invalid_image",
        ),
        (
            "truncated png",
            lambda: epd_stack.chat(
                _image_msg("data:image/png;base64," + base64.b64encode(tiny_png[: len(tiny_png) // 2]).decode()),
                **GREEDY,
            ),
            400,
            "invalid_image",
        ),
        (
            "bad base64",
            lambda: epd_stack.chat(_image_msg("data:image/png;base64,@@@###"), **GREEDY),
            400,
            "invalid_request",
        ),
        (
            "too many images",
            lambda: epd_stack.chat([user_message("x", [data_url(noise_image(63, (8, 8)))] * 3)], **GREEDY),
            400,
            "too_many_images",
        ),
        ("too large image", lambda: epd_stack.chat(_image_msg(too_large_url), **GREEDY), 400, "payload_too_large"),
        (
            "private url",
            lambda: epd_stack.chat(_image_msg("http://10.1.2.3/cat.png"), **GREEDY),
            400,
            "url_not_allowed",
        ),
        (
            "link-local url",
            lambda: epd_stack.chat(_image_msg("http://169.254.169.254/latest/meta-data"), **GREEDY),
            400,
            "url_not_allowed",
        ),
        (
            "ftp url",
            lambda: epd_stack.chat(_image_msg("ftp://example.com/a.png"), **GREEDY),
            400,
            "unsupported_content",
        ),
        (  # the client's URL is wrong: a 400, which the OpenAI SDK does not retry (issue 23.7)
            "url 404",
            lambda: epd_stack.chat(_image_msg(f"{image_server}/missing.png"), **GREEDY),
            400,
            "image_url_unavailable",
        ),
        (
            "unreachable url",
            lambda: epd_stack.chat(_image_msg(f"http://127.0.0.1:{closed_port()}/a.png"), **GREEDY),
            502,
            "image_fetch_failed",
        ),
        (
            "bad temperature",
            lambda: epd_stack.chat([{"role": "user", "content": "hi"}], temperature=7),
            400,
            "invalid_request",
        ),
        (
            "unknown model",
            lambda: httpx.post(
                f"{epd_stack.url}/v1/chat/completions",
                timeout=30,
                json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
            ),
            404,  # (as vLLM answers; OpenAI's code)
            "model_not_found",
        ),
        # Inputs that used to escape as plain-text 500s (issue 12):
        (
            "deeply nested json",
            lambda: _post_raw(epd_stack, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            400,
            "invalid_request",
        ),
        (
            "lone surrogate",
            lambda: _post_raw(
                epd_stack, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800b"}]}]}'
            ),
            400,
            "invalid_request",
        ),
        (
            "redirect to a data url",
            lambda: epd_stack.chat(_image_msg(f"{image_server}/to-data"), **GREEDY),
            400,
            "unsupported_content",
        ),
        (
            "request id with a newline",
            lambda: httpx.get(f"{epd_stack.url}/debug/requests/abc%0A", timeout=30),
            400,
            "invalid_request_id",
        ),
    ]
    for name, call, status, code in cases:
        resp = call()
        try:
            _assert_error(resp, status, code)
        except AssertionError as exc:
            raise AssertionError(f"case {name!r}: {exc}") from exc

    # An image the model's family cannot take (Qwen-VL: 200:1 and beyond) is refused by the API,
    # naming the limit, before any encode job is queued; one just inside the limit is served.
    encode_jobs = len(epd_stack.stream_messages("stream_encode"))
    resp = epd_stack.chat(_image_msg(data_url(noise_image(65, (1, 300)))), **GREEDY)
    _assert_error(resp, 400, "invalid_image")
    message = resp.json()["error"]["message"]
    assert "1x300, an aspect ratio of 300:1" in message and "(qwen2_vl) takes images below 200:1" in message
    assert len(epd_stack.stream_messages("stream_encode")) == encode_jobs
    ok = epd_stack.chat(_image_msg(data_url(noise_image(66, (199, 1)))), **GREEDY)
    assert ok.status_code == 200, ok.text

    # Still serving: an image by URL from the allow-listed loopback server, and a data URL.
    ok = epd_stack.chat(_image_msg(f"{image_server}/ok.png?X-Amz-Signature=s3cr3t#frag"), **GREEDY)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4
    # The request record keeps the URL without its query string and fragment (signatures, tokens).
    (record,) = epd_stack.messages_of("stream_requests", ChatRequestRecord, ok.json()["id"])
    (ref,) = [p for p in record.body["messages"][0]["content"] if p.get("type") == "image_ref"]
    assert ref["url"] == f"{image_server}/ok.png", ref
    ok = epd_stack.chat(_image_msg(data_url(noise_image(64, (56, 56)))), **GREEDY)
    assert ok.status_code == 200, ok.text


def test_api_keys_and_deadline(api_only_stack):
    """An API with no workers behind it: auth is enforced, and a request ends at its deadline."""
    r = httpx.get(f"{api_only_stack.url}/v1/models", timeout=10)
    _assert_error(r, 401, "invalid_api_key")
    r = httpx.get(f"{api_only_stack.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    _assert_error(r, 401, "invalid_api_key")
    r = httpx.get(f"{api_only_stack.url}/v1/models", headers={"Authorization": "Bearer sk-test-1"}, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "qwen2-vl-tiny"
    # The fields vLLM's `bench serve` reads (root: the model, when --model is left out).
    assert {k: r.json()["data"][0][k] for k in ("object", "root", "parent")} == {
        "object": "model",
        "root": "qwen2-vl-tiny",
        "parent": None,
    }
    # With keys configured, /metrics and /debug ask for one too (EPD_METRICS_PUBLIC is off).
    for path in ("/metrics", "/debug/requests/chatcmpl-0"):
        _assert_error(httpx.get(f"{api_only_stack.url}{path}", timeout=10), 401, "invalid_api_key")
    r = httpx.get(f"{api_only_stack.url}/metrics", headers={"Authorization": "Bearer sk-test-2"}, timeout=10)
    assert r.status_code == 200 and "epd:" in r.text

    # No worker answers: the request ends with 504 at the deadline the API was configured with
    # (EPD_REQUEST_TIMEOUT_S), not before it, and without hanging. Streaming too: the deadline
    # still ends it with a real status, before any byte is sent. (The API starts the clock when
    # the request arrives, after the client's; 50 ms allow for wall vs monotonic clock rates.)
    deadline_s = float(api_only_stack.env["EPD_REQUEST_TIMEOUT_S"])
    headers = {"Authorization": "Bearer sk-test-1"}
    for stream in (False, True):
        started = time.monotonic()
        r = api_only_stack.chat(
            [{"role": "user", "content": "hi"}], headers=headers, timeout=HANG_S, stream=stream, **GREEDY
        )
        elapsed = time.monotonic() - started
        _assert_error(r, 504, "deadline_exceeded")
        assert deadline_s - 0.05 <= elapsed < HANG_S, (stream, elapsed, deadline_s)
    # Both are on record as ended by the API with an error (not "incomplete": nothing else answered).
    abandoned = {
        m.request_id: m
        for _, _, m in api_only_stack.stream_messages("stream_results")
        if isinstance(m, ErrorEvent) and m.stage == "api"
    }
    assert len(abandoned) >= 2
    assert {(e.code, e.http_status) for e in abandoned.values()} == {("deadline_exceeded", 504)}

    async def statuses():
        import nats

        nc = await nats.connect(api_only_stack.nats_url)
        try:
            return {s.request_id: s.status for s in await list_requests(nc, api_only_stack.subjects, limit=50)}
        finally:
            await nc.close()

    listed = asyncio.run(statuses())
    assert all(listed[rid] == "error" for rid in abandoned)
    # /health stays public and reports no workers.
    h = httpx.get(f"{api_only_stack.url}/health", timeout=10).json()
    assert h["status"] == "ok" and h["workers"] == {}


def test_metrics_public_opens_only_the_metrics(tiny_model_dir):
    """EPD_METRICS_PUBLIC=1 lets a scraper read /metrics without a key; the API itself still asks
    for one (the control: without the setting, /metrics asks too)."""
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from shared.config import ApiSettings

    for public, metrics_status in ((True, 200), (False, 401)):
        app = create_app(ApiSettings(model_path=tiny_model_dir, api_keys="sk-test-1", metrics_public=public))
        client = TestClient(app)  # (no lifespan: these routes need no NATS)
        assert client.get("/metrics").status_code == metrics_status, public
        assert client.get("/v1/models").status_code == 401


def test_an_unexpected_exception_is_an_openai_error_with_an_id(tiny_model_dir, caplog):
    """A bug in a handler answers a JSON 500 (not Starlette's plain text) whose id is in the log
    line that has the traceback."""
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from shared.config import ApiSettings

    app = create_app(ApiSettings(model_path=tiny_model_dir))

    def broken():
        raise RuntimeError("boom")

    app.state.service.workers.live = broken  # /health reads it first
    r = TestClient(app, raise_server_exceptions=False).get("/health")
    _assert_error(r, 500, "internal_error")
    error_id = re.search(r"internal error (\w+) \(RuntimeError\)", r.json()["error"]["message"]).group(1)
    (line,) = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert line.exc_info and "boom" in str(line.exc_info[1])


def test_an_api_stopping_with_requests_in_flight_answers_them_with_a_json_503(
    nats_server, s3_server, tiny_model_dir, tmp_path
):
    """SIGTERM while requests wait (no worker: they would wait until the deadline): before uvicorn's
    graceful-shutdown timeout cuts them off (a plain-text 500), each ends with an OpenAI-shaped
    503, in-band for a stream; the requests are recorded as cancelled."""
    import signal

    from tests.stackutil import start_stack

    running = start_stack(
        nats_server,
        s3_server,
        tiny_model_dir,
        tmp_path,
        services=["api"],
        roles={},
        EPD_REQUEST_TIMEOUT_S="300",
        EPD_DRAIN_S="8",  # the API's drain: the 503s come 2 s before its end (the default 60 s is slow here)
    )
    body = {"model": "qwen2-vl-tiny", "messages": [user_message("hi", [])], "max_tokens": 4}
    out: dict[str, object] = {}

    def plain():
        out["plain"] = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=120)

    try:
        waiter = threading.Thread(target=plain)
        waiter.start()
        from tests.stackutil import wait_for

        wait_for(lambda: "accepted" in running.log_of("api"), 60, "the request to be accepted")
        (api,) = running.stack.processes
        api.popen.send_signal(signal.SIGTERM)
        waiter.join(120)
        resp = out["plain"]
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        api.popen.wait(60)  # (uvicorn re-raises the signal once it has shut down: killed by SIGTERM)
    finally:
        running.stack.stop()
    cancels = [m for _, _, m in running.stream_messages("stream_results") if isinstance(m, ErrorEvent)]
    assert [(e.code, e.stage) for e in cancels] == [("cancelled", "api")]


def test_refused_requests_are_recorded_and_listed(epd_stack, image_server):
    """Issue 23.7: a request refused before any job was published (a 4xx, a 502) is recorded - its
    ChatRequestRecord and an ErrorEvent - so `epd replay list --status error` and the
    /debug/requests index show it; the response names its id in X-Request-Id."""
    import nats

    missing = epd_stack.chat(_image_msg(f"{image_server}/missing.png?token=SECRET123"), **GREEDY)
    bad = epd_stack.chat([{"role": "user", "content": "hi"}], temperature=7)
    _assert_error(missing, 400, "image_url_unavailable")
    _assert_error(bad, 400, "invalid_request")
    assert "/missing.png" in missing.json()["error"]["message"] and "SECRET123" not in missing.text
    ids = [r.headers["x-request-id"] for r in (missing, bad)]

    async def errors():
        nc = await nats.connect(epd_stack.nats_url)
        try:
            found = await list_requests(nc, epd_stack.subjects, status="error", limit=500)
            return {s.request_id: s for s in found}
        finally:
            await nc.close()

    listed = asyncio.run(errors())
    assert set(ids) <= set(listed), ids
    assert "image_url_unavailable" in listed[ids[0]].error or "missing.png" in listed[ids[0]].error

    # The index page lists them, each linking its waterfall page, which renders.
    page = httpx.get(f"{epd_stack.url}/debug/requests", params={"status": "error", "limit": 500}, timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert all(f'href="/debug/requests/{rid}"' in page.text for rid in ids)
    as_json = httpx.get(
        f"{epd_stack.url}/debug/requests", params={"format": "json", "status": "error", "limit": 500}, timeout=30
    ).json()
    assert set(ids) <= {r["request_id"] for r in as_json["requests"]}
    assert all(r["status"] == "error" for r in as_json["requests"])
    waterfall = httpx.get(f"{epd_stack.url}/debug/requests/{ids[0]}", timeout=30)
    assert waterfall.status_code == 200 and "SECRET123" not in waterfall.text
    assert httpx.get(f"{epd_stack.url}/debug/requests", params={"status": "nope"}, timeout=30).status_code == 400


def test_the_api_exports_the_scaling_signal_on_its_metrics(api_only_stack) -> None:
    """One place to scrape (issue 44; ``services.api.scaling``, tests/test_scaling_signal.py): the
    API's ``/metrics`` carries every worker role's three scaling gauges."""
    url = api_only_stack.url

    def exported() -> bool:
        text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-test-1"}, timeout=10).text
        return all(
            f'{name}{{role="{role.value}"}}' in text
            for name in ("epd:pending_work_seconds", "epd:queue_lag_jobs", "epd:job_cost_seconds")
            for role in (Service.ENCODER, Service.PREFILL, Service.DECODE)
        )

    wait_for(exported, 30, "the scaling gauges on /metrics")
