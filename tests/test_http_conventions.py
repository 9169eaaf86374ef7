"""The conventions of vLLM's OpenAI server that users and their tooling expect (issue 41, items 7-9):
X-Request-Id, CORS, 404 model_not_found, max_tokens bounded by the context served, /v1/models'
created and max_model_len, /ping, the access log, HTTP request metrics and no ``*_created``
series; log lines (enum values, one request_id, uvicorn's logger name, worker ids); the debug
pages (question, answer, link back, 1280 px)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from shared import history, protocol, timeline
from shared.logs import RequestIdFilter, plain
from shared.protocol import ChatRequestRecord, ECSource, FinalResult, TokenChunk

ORIGIN = "http://ui.example"
CONTEXT = 64  # EPD_MAX_MODEL_LEN of the app under test (the tiny model's own is larger)


def _client(tiny_model_dir, **settings):
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from shared.config import ApiSettings

    # (no lifespan: the routes tried here need no NATS; those that do answer 503)
    return TestClient(create_app(ApiSettings(model_path=tiny_model_dir, **settings)))


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    return _client(tiny_model_dir, allowed_origins=ORIGIN, max_model_len=CONTEXT)


def _chat(client, **body):
    return client.post(
        "/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", "messages": [{"role": "user", "content": "hi"}], **body},
    )


# -- X-Request-Id ---------------------------------------------------------------------------------
def test_every_response_carries_an_x_request_id_and_a_clients_is_echoed(client):
    """Mutation: HttpConventions adding no header when the response has none -> the /v1/models,
    404 and 405 responses carry none."""
    seen = set()
    for r in (client.get("/v1/models"), client.get("/nope"), client.delete("/v1/models"), _chat(client, n=0)):
        rid = r.headers.get("x-request-id")
        assert rid and re.fullmatch(r"[A-Za-z0-9_-]+", rid), (r.status_code, r.headers)
        seen.add(rid)
    assert len(seen) == 4  # one per response
    assert _chat(client, n=0).headers["x-request-id"].startswith("chatcmpl-")  # a generation's own id

    # A client's id comes back as it was sent, on every route.
    assert client.get("/v1/models", headers={"X-Request-Id": "trace-1"}).headers["x-request-id"] == "trace-1"
    r = client.post(
        "/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0},
        headers={"X-Request-Id": "0f8fad5b-d9cb-469f-a165-70867728950e"},
    )
    assert r.status_code == 400 and r.headers["x-request-id"] == "0f8fad5b-d9cb-469f-a165-70867728950e"

    # One that cannot be a request id (it names NATS subjects): a clear 400, not silently replaced.
    for bad in ("a.b", "x" * 129, "a b", "é".encode()):
        r = client.get("/v1/models", headers={"X-Request-Id": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_request_id" and r.json()["error"]["param"] == "X-Request-Id"
        assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])  # the API's own


# -- CORS -----------------------------------------------------------------------------------------
def test_cors_answers_the_preflight_and_marks_responses_for_allowed_origins_only(client, tiny_model_dir):
    """Mutation: with_cors returning the app unwrapped -> the preflight is a 405 and no
    Access-Control-Allow-Origin is sent."""
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"]
    assert "access-control-allow-credentials" not in r.headers  # off unless EPD_ALLOW_CREDENTIALS
    # The generation route (served in front of FastAPI) and the others get the header too, and the
    # page may read X-Request-Id.
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0},
        headers={"Origin": ORIGIN},
    )
    for resp in (chat, client.get("/v1/models", headers={"Origin": ORIGIN})):
        assert resp.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
    # Another origin: refused preflight, no allow header.
    assert client.options("/v1/models", headers={**preflight, "Origin": "http://evil.example"}).status_code == 400
    assert (
        "access-control-allow-origin" not in client.get("/v1/models", headers={"Origin": "http://evil.example"}).headers
    )
    # Unset (the default): no CORS at all.
    plain_client = _client(tiny_model_dir)
    assert "access-control-allow-origin" not in plain_client.get("/v1/models", headers={"Origin": ORIGIN}).headers
    assert plain_client.options("/v1/models", headers=preflight).status_code == 405


def test_credentials_with_any_origin_is_refused():
    from pydantic import ValidationError

    from shared.config import ApiSettings

    with pytest.raises(ValidationError, match="EPD_ALLOW_CREDENTIALS"):
        ApiSettings(allowed_origins="*", allow_credentials=True)
    ApiSettings(allowed_origins=ORIGIN, allow_credentials=True)


# -- model, max_tokens, /v1/models, /ping -----------------------------------------------------------
def test_a_wrong_model_is_a_404_model_not_found(client):
    """vLLM answers 404 ("The model `x` does not exist."); OpenAI's code is model_not_found.
    Mutation: check_model raising InvalidRequest -> 400."""
    for r in (
        _chat(client, model="gpt-4o"),
        client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "hi"}),
        client.get("/v1/models/gpt-4o"),
        client.post("/tokenize", json={"model": "gpt-4o", "prompt": "hi"}),
    ):
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model", err
        assert "The model `gpt-4o` does not exist" in err["message"] and "qwen2-vl-tiny" in err["message"]


def test_max_tokens_is_bounded_by_the_context_served_and_the_error_names_what_sets_it(client, tiny_model_dir):
    """Mutation: the API's limit back to a flat EPD_MAX_TOKENS_LIMIT of 4096 -> 65 passes."""
    r = _chat(client, max_tokens=CONTEXT + 1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"[1, {CONTEXT}]" in r.json()["error"]["message"] and "EPD_MAX_MODEL_LEN" in r.json()["error"]["message"]
    assert _chat(client, max_tokens=CONTEXT).status_code == 503  # accepted; no NATS behind this app
    # Without EPD_MAX_MODEL_LEN: the model's own context, named as such.
    model_len = protocol_model_len(tiny_model_dir)
    other = _client(tiny_model_dir)
    msg = _chat(other, max_tokens=model_len + 1).json()["error"]["message"]
    assert f"[1, {model_len}]" in msg and "max_position_embeddings" in msg, msg
    # EPD_MAX_TOKENS_LIMIT below the context: named instead.
    msg = _chat(_client(tiny_model_dir, max_tokens_limit=20), max_tokens=21).json()["error"]["message"]
    assert "[1, 20]" in msg and "EPD_MAX_TOKENS_LIMIT" in msg, msg


def protocol_model_len(model_dir: Path) -> int:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return (config.get("text_config") or config)["max_position_embeddings"]


def test_the_model_card_has_a_real_created_and_the_context_served(client, tiny_model_dir):
    """Mutation: created back to 0."""
    card = client.get("/v1/models").json()["data"][0]
    assert card["created"] == int((tiny_model_dir / "config.json").stat().st_mtime) > 0
    assert card["max_model_len"] == CONTEXT and card["id"] == card["root"] == "qwen2-vl-tiny"
    assert client.get("/v1/models/qwen2-vl-tiny").json() == card


def test_ping_answers_get_and_post(client, api_only_stack):
    """Mutation: no POST route -> 405."""
    for method in ("GET", "POST"):
        assert client.request(method, "/ping").status_code == 503  # no NATS behind the bare app
        r = httpx.request(method, f"{api_only_stack.url}/ping", timeout=10)  # (no key needed: a probe)
        assert r.status_code == 200 and r.content == b"", (method, r.status_code, r.text)


# -- access log, HTTP metrics, no *_created series --------------------------------------------------
def test_access_log_one_line_per_request_and_switchable(client, tiny_model_dir, caplog):
    """Mutation: access_log.info removed -> no line."""
    caplog.set_level(logging.INFO, logger="epd.access")
    client.get("/v1/models?x=1", headers={"X-Request-Id": "log-1"})
    _chat(client, model="nope")
    lines = [r for r in caplog.records if r.name == "epd.access"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    assert re.search(r'"GET /v1/models\?x=1 HTTP/1.1" 200 [\d.]+ ms$', lines[0].getMessage()), lines[0].getMessage()
    assert lines[0].request_id == "log-1"
    assert '"POST /v1/chat/completions HTTP/1.1" 404' in lines[1].getMessage()
    assert lines[1].request_id.startswith("chatcmpl-")
    caplog.clear()
    _client(tiny_model_dir, access_log=False).get("/v1/models")
    assert not [r for r in caplog.records if r.name == "epd.access"]


def test_http_request_metrics_and_no_created_series(client):
    """Mutations: disable_created_metrics() removed -> *_created lines; the metrics' inc removed."""
    client.get("/v1/models")
    _chat(client, model="nope")
    text = client.get("/metrics").text
    assert re.search(r'^http_requests_total\{handler="/v1/models",method="GET",status="2xx"\} [1-9]', text, re.M)
    assert re.search(
        r'^http_requests_total\{handler="/v1/chat/completions",method="POST",status="4xx"\} [1-9]', text, re.M
    )
    assert re.search(r'^http_request_duration_seconds_count\{handler="/v1/models",method="GET"\} [1-9]', text, re.M)
    assert 'handler="/metrics"' not in text  # (left out, as vLLM leaves it out)
    created = [line for line in text.splitlines() if "_created" in line]
    assert not created, created[:5]


# -- the generation id with a client's X-Request-Id, on a real API -------------------------------------
def test_a_generation_request_id_carries_the_clients_x_request_id(api_only_stack):
    """The request id is chatcmpl-<client id>-<suffix> (the suffix keeps two requests with one
    header apart); the response echoes the client's. Mutation: the client's id left out -> the
    refused request is listed without it."""
    key = {"Authorization": "Bearer sk-test-1"}
    r = httpx.post(
        f"{api_only_stack.url}/v1/chat/completions",
        json={"model": "qwen2-vl-tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0},
        headers={**key, "X-Request-Id": "trace-77"},
        timeout=30,
    )
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-77", r.text

    def listed():
        body = httpx.get(f"{api_only_stack.url}/debug/requests?format=json&status=error", headers=key, timeout=10)
        return [q["request_id"] for q in body.json()["requests"] if "trace-77" in q["request_id"]]

    from tests.stackutil import wait_for

    (rid,) = wait_for(listed, 30, "the refused request to be listed")
    assert re.fullmatch(r"chatcmpl-trace-77-[0-9a-f]{8}", rid), rid


# -- logs -------------------------------------------------------------------------------------------
def test_log_lines_show_enum_values_and_uvicorns_start_up_under_a_plain_name():
    """Mutations: plain() with repr() -> "<ECSource.STORE: 'store'>"; no rename -> uvicorn.error."""
    assert plain({"ab" * 32: ECSource.STORE, "cd" * 32: ECSource.LOCAL_CACHE}) == (
        "abababababab=store,cdcdcdcdcdcd=local_cache"
    )
    assert plain({}) == "-"
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Uvicorn running on %s", ("x",), None)
    RequestIdFilter().filter(record)
    assert record.name == "uvicorn" and record.request_id == "-"


def test_tensor_store_lines_carry_the_request_id_once(tmp_path, caplog):
    """Mutation: the message's own "request_id=%s" back -> twice on the line."""
    from shared.config import StoreSettings
    from shared.logs import LOG_FORMAT
    from shared.store.factory import open_stores
    from shared.store.format import ObjectValidationError

    stores = open_stores(
        StoreSettings(store_backend="fs", store_fs_root=tmp_path / "store"),
        producer="w",
        ec_fingerprint="fp",
        max_media_bytes=1 << 20,
        ensure_bucket=True,
    )
    ec = stores.ec_store()
    caplog.set_level(logging.DEBUG)
    formatter = logging.Formatter(LOG_FORMAT)
    with pytest.raises(ObjectValidationError):  # not stored: a miss
        ec.load("ab" * 32, request_id="req-42")
    lines = [formatter.format(r) for r in caplog.records if " miss " in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    for line in lines:
        assert line.count("request_id=") == 1 and "[request_id=req-42]" in line, line


def test_epd_up_worker_ids_carry_no_pid(tmp_path):
    """Mutation: the supervisor's pid back in the id."""
    from shared.tools.launcher import Stack

    a, b = Stack(env={}, log_dir=tmp_path), Stack(env={}, log_dir=tmp_path)
    ids = {a.worker_id("encoder", 0), a.worker_id("prefill", 1), b.worker_id("encoder", 0)}
    assert len(ids) == 3 and a.worker_id("encoder", 0) == a.worker_id("encoder", 0)  # kept across restarts
    assert all(str(os.getpid()) not in i for i in ids), ids
    assert re.fullmatch(r"encoder-0-[0-9a-f]{6}", a.worker_id("encoder", 0))


# -- debug pages --------------------------------------------------------------------------------------
def _case(question: str, answer: str) -> history.RequestCase:
    rid = "chatcmpl-1"
    t0 = 1_700_000_000.0
    record = ChatRequestRecord(
        request_id=rid,
        received_at=t0,
        model="m",
        body={
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "image_ref", "item_hash": "ab"}, {"type": "text", "text": question}],
                },
            ]
        },
    )
    chunks = [
        TokenChunk(request_id=rid, attempt=1, seq=i, token_ids=(i,), text=part)
        for i, part in enumerate([answer[: len(answer) // 2], answer[len(answer) // 2 :]])
    ]
    final = FinalResult(
        request_id=rid,
        attempt=1,
        token_ids=(0, 1),
        text=answer,
        finish_reason="stop",
        prompt_tokens=5,
        completion_tokens=2,
    )

    def sm(seq, t, msg):
        headers = protocol.headers_for(msg, rid)
        return history.StreamMessage.build("S", seq, "subj", t, headers, protocol.encode(msg))

    return history.RequestCase(
        rid,
        [sm(1, t0, record)]
        + [sm(2 + i, t0 + 0.1 * (i + 1), c) for i, c in enumerate(chunks)]
        + [sm(9, t0 + 0.5, final)],
    )


def test_the_waterfall_page_shows_the_question_and_the_answer_escaped_and_bounded_and_links_back():
    """Mutations: the question/answer section removed; html.escape left out of it (the script runs)."""
    page = timeline.render_html(
        _case("What <b>colour</b>?<script>alert(1)</script>", "red</pre><img src=x onerror=alert(1)>"),
        index_href="../requests",
    )
    assert '<a href="../requests">' in page
    assert "user: [image] What &lt;b&gt;colour&lt;/b&gt;?&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "system: be brief" in page
    assert "red&lt;/pre&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<script" not in page and "<img" not in page
    long_page = timeline.render_html(_case("q", "y" * (timeline.SHOWN_TEXT_CHARS + 500)))
    assert "y" * timeline.SHOWN_TEXT_CHARS + "\u2026 (500 more characters)" in long_page
    assert "recent requests" not in long_page  # (no link unless asked: a page written to a file)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs a headless chromium (apt-get install chromium)")
def test_the_index_fits_a_1280_px_window(tmp_path):
    """Long ids, a long unbreakable error: the page is no wider than the window. Mutation: the
    table's fixed layout removed -> ~2000 px."""
    import time

    from services.api.debug_pages import requests_index_html

    rows = [
        history.Summary(
            request_id=f"chatcmpl-{'trace' * 25}-{i:08x}",
            received_at=time.time() - i,
            status="error" if i % 2 else "ok",
            images=1,
            prompt_tokens=80,
            completion_tokens=12,
            ttft_s=0.1,
            e2e_s=0.4,
            error="fetch_failed: http://" + "a" * 300 + ".example/x.png" if i % 2 else "",
            replay_of="chatcmpl-" + "f" * 32,
        )
        for i in range(6)
    ]
    # The page has no script: a copy with one reports its width in the title.
    page = requests_index_html(rows, status=None, since_s=3600).replace(
        "</body>", "<script>document.title = 'W' + document.documentElement.scrollWidth</script></body>"
    )
    path = tmp_path / "index.html"
    path.write_text(page)
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1280,800",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    width = int(re.search(r"<title>W(\d+)</title>", out.stdout).group(1))
    assert width <= 1280, width


# -- epd up --served-model-name / --max-model-len, on a real stack ------------------------------------
@pytest.mark.slow
def test_epd_up_serves_the_name_and_context_it_was_given_and_its_logs_read_plainly(tiny_model_dir, tmp_path):
    """`epd up --served-model-name --max-model-len` reach the API and the engine: the model card,
    a 404 for the folder's name, the API's max_tokens bound and the worker's prompt + max_tokens
    bound (the transformers engine, vLLM's wording) name EPD_MAX_MODEL_LEN. Its logs: uvicorn's
    lines not under uvicorn.error, an access line per request, sources as values, worker ids
    without epd up's pid. Mutations: the flags not passed to the services (EPD_MODEL_NAME /
    EPD_MAX_MODEL_LEN left out of epd up's env) -> the card shows the folder's name / the model's
    length; the engine ignoring max_model_len -> the long prompt is served."""
    from tests.epdup import EpdUp

    context = 96
    up = EpdUp(
        tmp_path, "--model", str(tiny_model_dir), "--topology", "agg", "--served-model-name", "tiny-served",
        "--max-model-len", str(context),
    )  # fmt: skip
    try:
        m = up.wait_ready()
        assert m["model"] == "tiny-served", m.group(0)
        card = httpx.get(f"{up.url}/v1/models", timeout=30).json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("tiny-served", context), card

        def chat(model="tiny-served", text="Say hi.", **body):
            return httpx.post(
                f"{up.url}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, **body},
                timeout=120,
            )

        assert chat(model=tiny_model_dir.name, max_tokens=2).status_code == 404
        r = chat(max_tokens=context + 1)
        assert r.status_code == 400 and "EPD_MAX_MODEL_LEN" in r.json()["error"]["message"], r.text
        # Within max_tokens' bound, over the context with the prompt: the worker says so (a 400).
        r = chat(text="one two three four five six seven eight " * 12, max_tokens=context - 8)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and "maximum context length is 96 tokens" in err["message"], err
        assert "EPD_MAX_MODEL_LEN" in err["message"] and "input tokens" in err["message"], err
        ok = chat(max_tokens=3)
        assert ok.status_code == 200 and ok.headers["x-request-id"] == ok.json()["id"], (ok.headers, ok.text)

        from tests.stackutil import wait_for

        logs = up.data_dir / "logs"
        access = r'epd\.access \[request_id=chatcmpl-\w+\] \S+ - "POST /v1/chat/completions HTTP/1.1" 200 '
        # (the access line is written once the response went out: it may come after the client has it)
        wait_for(lambda: re.search(access, (logs / "api-0.log").read_text(errors="replace")), 60, "the access line")
        api_log = (logs / "api-0.log").read_text(errors="replace")
        assert "uvicorn.error" not in api_log and " uvicorn [request_id=-] Uvicorn running on" in api_log, api_log[
            -2000:
        ]

        def worker_logs() -> str:
            return "".join(p.read_text(errors="replace") for p in logs.glob("*.log") if not p.name.startswith("api"))

        # (the worker writes its done line after it published the result: it may come after the response)
        wait_for(
            lambda: re.search(r"done: \d+ prompt \+ 3 completion tokens.* sources=-", worker_logs()),
            60,
            "the worker's done line with its sources as values",
        )
        assert "<ECSource" not in worker_logs() + api_log
        ids = set(re.findall(r" worker (\S+) consuming ", worker_logs()))
        assert ids and all(re.fullmatch(r"\w+-0-[0-9a-f]{6}", i) and str(up.proc.pid) not in i for i in ids), ids
    finally:
        up.close()


@pytest.mark.vllm
def test_a_vllm_context_refusal_names_what_sets_the_length():
    """vLLM refuses a prompt over its max_model_len in its own words; the 400 says where the
    length comes from. Mutation: the note left out."""
    from vllm.exceptions import VLLMValidationError

    from shared.engines.vllm_engine import _translate
    from shared.errors import InvalidRequest

    err = _translate(
        VLLMValidationError(
            "The decoder prompt (length 120) is longer than the maximum model length of 96.", parameter="input_tokens"
        )
    )
    assert isinstance(err, InvalidRequest) and "EPD_MAX_MODEL_LEN" in err.message, err
    other = _translate(ValueError("bad stop"))
    assert isinstance(other, InvalidRequest) and "EPD_MAX_MODEL_LEN" not in other.message
