"""``epd bench run``: the workload generator, the statistics and one real run.

* The plan is deterministic for a seed (requests, prompts, arrivals and image bytes), another
  seed gives another plan (negative control), and a large plan honours the spec's shares within
  statistical bounds; repeats pick among the last ``repeat_window`` images; multi-turn
  conversations carry their history; images are built only when a body is.
* ``summarize`` on a synthetic record set gives the hand-computed percentiles (numpy's linear
  interpolation), throughputs, goodput, stage means and EC counts; timelines parse into stage
  wall times (overlapping spans counted once) and the worker's EC sources.
* End to end (slow): the ``epd`` CLI in a subprocess runs a short workload against a real
  api + encoder + prefill stack and writes a JSON result that ``schema.load`` reads back, with
  every request complete, the requested token counts, stage timings (union and exclusive) and EC
  sources; a request
  the server refuses is recorded as failed, not raised.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math

import pytest
from PIL import Image

from shared.protocol import StageName
from shared.tools.bench import report, runner, schema, workload
from shared.tools.bench.schema import RequestRecord, WorkloadSpec
from tests.stackutil import epd_cli

EC_STAGES = {
    StageName.EC_FROM_LOCAL_CACHE,
    StageName.EC_LOADED_FROM_STORE,
    StageName.EC_RECOMPUTED,
    StageName.EC_ENCODED_IN_PROCESS,
}


def spec(**fields) -> WorkloadSpec:
    return workload.check_spec(WorkloadSpec(**fields))


def images_of(req: workload.PlannedRequest) -> list[bytes]:
    return [workload.image_bytes(req.seed, req.run_index, im.id, im.width, im.height) for im in req.images]


# -- the workload -------------------------------------------------------------------------------
MIXED = dict(
    requests=60,
    text_only_share=0.2,
    repeat_share=0.4,
    images_per_request={1: 0.6, 2: 0.4},
    image_sizes={"64x64": 0.5, "96x48": 0.5},
    prompt_words=(4, 12),
    output_tokens=(8, 24),
    turns=2,
)


def test_plan_is_deterministic_for_a_seed():
    a, b = workload.plan(spec(seed=7, **MIXED)), workload.plan(spec(seed=7, **MIXED))
    assert a == b
    assert [r.body("m") for r in a] == [r.body("m") for r in b]  # the image data URLs too
    assert [images_of(r) for r in a] == [images_of(r) for r in b]
    kinds = {r.kind for r in a}
    assert kinds == {"text", "image", "repeat"}, kinds
    # Negative control: another seed gives other prompts, lengths, kinds and image bytes.
    c = workload.plan(spec(seed=8, **MIXED))
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.output_tokens for r in a] != [r.output_tokens for r in c]
    assert [r.kind for r in a] != [r.kind for r in c]
    first = next(r for r in a if r.images)
    other = next(r for r in c if r.images)
    assert images_of(first)[0] != images_of(other)[0]
    # A sweep's later run keeps the requests but draws new images (no cross-run cache hits).
    later = workload.plan(spec(seed=7, **MIXED), run_index=1)
    assert [(r.kind, r.prompt, r.output_tokens) for r in later] == [(r.kind, r.prompt, r.output_tokens) for r in a]
    assert images_of(later[a.index(first)])[0] != images_of(first)[0]


def test_plan_honours_the_shares():
    n = 6000
    s = spec(
        seed=3,
        requests=n,
        text_only_share=0.25,
        repeat_share=0.3,
        repeat_window=8,
        images_per_request={1: 0.7, 3: 0.3},
        image_sizes={"64x64": 0.75, "32x32": 0.25},
        prompt_words=(5, 9),
        output_tokens=(10, 20),
    )
    reqs = workload.plan(s)
    assert len(reqs) == n and [r.index for r in reqs] == list(range(n))

    def within(count: int, total: int, p: float) -> None:
        sigma = math.sqrt(p * (1 - p) / total)
        assert abs(count / total - p) < 5 * sigma, (count, total, p)

    text = [r for r in reqs if r.kind == "text"]
    with_images = [r for r in reqs if r.images]
    within(len(text), n, 0.25)
    assert all(not r.images for r in text) and len(text) + len(with_images) == n
    within(sum(1 for r in with_images if r.kind == "repeat"), len(with_images), 0.3)
    within(sum(1 for r in with_images if len(r.images) == 3), len(with_images), 0.3)
    assert {len(r.images) for r in with_images} == {1, 3}
    fresh = {im.id: im for r in with_images if r.kind == "image" for im in r.images}
    within(sum(1 for im in fresh.values() if (im.width, im.height) == (64, 64)), len(fresh), 0.75)
    assert {(im.width, im.height) for im in fresh.values()} == {(64, 64), (32, 32)}
    words = [len(r.prompt.split()) for r in reqs]
    outs = [r.output_tokens for r in reqs]
    assert min(words) == 5 and max(words) == 9 and min(outs) == 10 and max(outs) == 20
    assert abs(sum(outs) / n - 15) < 0.3

    # A repeat's images are all among the last `repeat_window` distinct images before it; an
    # "image" request brings at least one new one.
    seen: list[int] = []
    for r in with_images:
        ids = [im.id for im in r.images]
        if r.kind == "repeat":
            assert set(ids) <= set(seen[-8:]), (r.index, ids, seen[-8:])
        else:
            assert any(i not in seen for i in ids)
        seen += [i for i in ids if i not in seen]


def test_poisson_arrivals_and_duration():
    s = spec(seed=5, requests=None, duration_s=400.0, arrival="poisson", rate=4.0, text_only_share=1.0)
    reqs = workload.plan(s)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[-1] <= 400.0
    # ~1600 arrivals: the count of a Poisson process (sd = sqrt(1600) = 40) and mean gap 0.25 s.
    assert abs(len(reqs) - 1600) < 200, len(reqs)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert abs(sum(gaps) / len(gaps) - 0.25) < 0.025
    # The same requests at another rate: other offsets, same content.
    slow = workload.plan(spec(seed=5, requests=20, arrival="poisson", rate=1.0, text_only_share=1.0))
    assert [r.prompt for r in slow] == [r.prompt for r in reqs[:20]]
    assert slow[-1].arrival_s > reqs[19].arrival_s
    # A concurrency workload has no arrival times; a duration-only one has no fixed length.
    assert {r.arrival_s for r in workload.plan(spec(requests=5))} == {0.0}
    with pytest.raises(ValueError, match="iter_plan"):
        workload.plan(spec(requests=None, duration_s=10.0))


def test_conversations_and_request_bodies():
    s = spec(
        seed=11, requests=9, turns=3, images_per_request={2: 1.0}, image_sizes={"48x32": 1.0}, output_tokens=(7, 7)
    )
    reqs = workload.plan(s)
    assert [r.turn for r in reqs] == [0, 1, 2] * 3
    assert [r.kind for r in reqs] == ["image", "repeat", "repeat"] * 3
    for r in reqs:
        first = reqs[r.index - r.turn]
        assert r.images == first.images and r.conversation == first.conversation
        assert len(r.history) == r.turn and [t.user for t in r.history] == [
            q.prompt for q in reqs[first.index : r.index]
        ]
        body = r.body("tiny", extra={"return_token_ids": True})
        assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
        msgs = body["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * r.turn + ["user"]
        parts = msgs[0]["content"]
        assert [p["type"] for p in parts] == ["image_url", "image_url", "text"]
        assert msgs[-1]["content"] in (r.prompt, parts)
        for p in parts[:2]:
            url = p["image_url"]["url"]
            assert url.startswith("data:image/jpeg;base64,")
            img = Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2])))
            assert img.size == (48, 32) and img.mode == "RGB"
    assert "ignore_eos" not in reqs[0].body("tiny", ignore_eos=False)
    # Images are drawn when a body is built, not when the plan is made.
    workload.image_bytes.cache_clear()
    big = workload.plan(spec(seed=12, requests=200, image_sizes={"640x640": 1.0}))
    assert workload.image_bytes.cache_info().currsize == 0
    big[0].body("tiny")
    assert workload.image_bytes.cache_info().currsize == 1


def test_spec_from_yaml_and_flags(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(
        "seed: 4\nrequests: 30\nrate: 2.5\nimages_per_request: {1: 0.5, 2: 0.5}\n"
        "image_sizes: {'64x64': 1}\nprompt_words: [3, 5]\n"
    )
    s = workload.load_spec(path)
    assert (s.seed, s.requests, s.arrival, s.rate, s.images_per_request, s.prompt_words) == (
        4,
        30,
        "poisson",
        2.5,
        {1: 0.5, 2: 0.5},
        (3, 5),
    )
    s = workload.load_spec(path, {"seed": 9, "duration_s": 12.0, "requests": None})
    assert (s.seed, s.requests, s.duration_s, s.rate) == (9, 30, 12.0, 2.5)  # None: not given
    only_duration = tmp_path / "d.yaml"
    only_duration.write_text("duration_s: 5\n")
    assert workload.load_spec(only_duration).requests is None  # not the default 50
    for bad in (
        {"repeat_share": 1.5},
        {"image_sizes": {"64by64": 1.0}},
        {"arrival": "poisson"},
        {"output_tokens": (5, 2)},
    ):
        with pytest.raises(ValueError, match="invalid workload"):
            workload.load_spec(None, bad)
    # The CLI: flags over the file; a load flag replaces the file's load (its sweep).
    from shared.tools.bench.cli import spec_from_args
    from shared.tools.cli import build_parser

    swept = tmp_path / "sweep.yaml"
    swept.write_text("sweep: [1, 2]\nrequests: 5\nturns: 2\n")

    def cli_spec(*flags: str) -> WorkloadSpec:
        return spec_from_args(
            build_parser().parse_args(["bench", "run", "--url", "http://x", "--workload", str(swept), *flags])
        )

    s = cli_spec("--seed", "2", "--image-sizes", "64x64:3,32x32:1", "--prompt-words", "2,3", "--slo", "ttft=9")
    assert (s.arrival, s.sweep, s.seed, s.requests, s.turns, s.image_sizes, s.prompt_words) == (
        "poisson",
        (1.0, 2.0),
        2,
        5,
        2,
        {"64x64": 3.0, "32x32": 1.0},
        (2, 3),
    )
    s = cli_spec("--concurrency", "3", "--images-per-request", "1:1,2:3")
    assert (s.arrival, s.sweep, s.concurrency, s.images_per_request) == ("concurrency", (), 3, {1: 1.0, 2: 3.0})
    assert (cli_spec("--rate", "0.5").arrival, cli_spec("--rate", "0.5").sweep) == ("poisson", ())
    with pytest.raises(ValueError, match="sweep needs arrival"):
        workload.check_spec(WorkloadSpec(sweep=(1.0,)))
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("request: 3\n")  # a typo is refused, not ignored
    with pytest.raises(ValueError, match="request"):
        workload.load_spec(bad_key)


# -- statistics -----------------------------------------------------------------------------------
def _rec(index: int, ok: bool = True, **fields) -> RequestRecord:
    return RequestRecord(index=index, kind="image", images=1, sent_at=0.0, ok=ok, **fields)


RECORDS = [
    _rec(
        0,
        ttft_s=0.1,
        e2e_s=1.0,
        output_tokens=10,
        prompt_tokens=20,
        itl_s=(0.1,) * 9,
        stages={"prefill": 0.1, "encode": 0.2},
        ec_sources={"a": "store", "b": "recomputed:stale"},
    ),
    _rec(
        1,
        ttft_s=0.2,
        e2e_s=2.2,
        output_tokens=11,
        prompt_tokens=20,
        itl_s=(0.2, 0.2),
        stages={"prefill": 0.3},
        ec_sources={"c": "store"},
    ),
    _rec(2, ttft_s=0.3, e2e_s=0.3, output_tokens=1, prompt_tokens=10),
    _rec(3, ttft_s=0.4, e2e_s=4.4, output_tokens=5, prompt_tokens=30, itl_s=(1.0,), ec_sources={"d": "local_cache"}),
    _rec(
        4,
        ok=False,
        status=503,
        error="unavailable",
        ttft_s=0.01,
        output_tokens=3,
        prompt_tokens=99,
        stages={"prefill": 9.0},
        ec_sources={"e": "store"},
    ),
]


def _stats(s, mean, median, p90, p99, std=None):
    assert s is not None
    assert (s.mean, s.median, s.p90, s.p99) == pytest.approx((mean, median, p90, p99), abs=1e-9)
    if std is not None:
        assert s.std == pytest.approx(std, abs=1e-9)


def test_summarize_gives_hand_computed_figures():
    s = report.summarize(RECORDS, 10.0)
    assert (s.completed, s.failed, s.duration_s) == (4, 1, 10.0)
    assert (s.request_throughput, s.output_token_throughput, s.total_token_throughput) == pytest.approx(
        (0.4, 2.7, 10.7), abs=1e-12
    )
    # TTFT 100/200/300/400 ms: p90 at rank 2.7 -> 300 + 0.7 * 100
    _stats(s.ttft_ms, 250, 250, 370, 397, math.sqrt(12500))
    # TPOT (e2e - ttft) / (n - 1): 0.9/9, 2.0/10, 4.0/4 (the one-token request has none)
    _stats(s.tpot_ms, 1300 / 3, 200, 840, 984)
    # ITL pooled: nine 100s, two 200s, one 1000 (ranks 0..11)
    _stats(s.itl_ms, 2300 / 12, 100, 200, 912)
    _stats(s.e2e_ms, 1975, 1600, 3740, 4334)
    assert s.goodput is None and s.slo_ms == {}
    assert s.stage_means_s == pytest.approx({"prefill": 0.2, "encode": 0.2})  # the failed one left out
    assert s.ec_counts == {"local_cache": 1, "recomputed": 1, "store": 2}


def test_goodput_and_slo_parsing():
    assert report.parse_slo("ttft=250, tpot=150") == {"ttft": 250.0, "tpot": 150.0}
    assert report.parse_slo("e2el=2500") == {"e2e": 2500.0}
    for bad in ("ttft", "ttft=x", "speed=3", "tpot=0", ""):
        with pytest.raises(Exception, match="SLO"):
            report.parse_slo(bad)
    good = lambda slo: report.summarize(RECORDS, 10.0, slo).goodput  # noqa: E731 - a one-line helper
    assert good({"ttft": 250, "tpot": 150}) == pytest.approx(0.1)  # request 0 only
    assert good({"ttft": 350, "tpot": 150}) == pytest.approx(0.2)  # + request 2 (one token: no TPOT)
    assert good({"e2e": 2500}) == pytest.approx(0.3)
    assert good({"ttft": 1}) == 0.0
    assert report.summarize(RECORDS, 10.0, {"ttft": 250}).slo_ms == {"ttft": 250}


def test_empty_and_all_failed_runs():
    s = report.summarize([_rec(0, ok=False, status=400)], 2.0, {"ttft": 100})
    assert (s.completed, s.failed, s.request_throughput, s.goodput) == (0, 1, 0.0, 0.0)
    assert s.ttft_ms is s.tpot_ms is s.itl_ms is s.e2e_ms is None


def test_format_result_prints_every_run():
    summary = report.summarize(RECORDS, 10.0, {"ttft": 250})
    run = schema.RunResult(rate=None, concurrency=2, requests=tuple(RECORDS), summary=summary)
    result = schema.BenchResult(
        label="synthetic",
        url="http://x",
        model="m",
        epd=True,
        started_at=0.0,
        machine="test",
        spec=WorkloadSpec(),
        runs=(run, schema.RunResult(rate=1.5, concurrency=None, requests=tuple(RECORDS), summary=summary)),
    )
    text = report.format_result(result)
    assert text.count("Serving Benchmark Result") == 2 and "concurrency 2" in text and "rate 1.5 req/s" in text
    for name, value in (
        ("Successful requests:", "4"),
        ("Failed requests:", "1"),
        ("Total input tokens:", "80"),
        ("Total generated tokens:", "27"),
        ("Mean TTFT (ms):", "250.00"),
        ("P99 E2EL (ms):", "4334.00"),
        ("Request goodput (req/s):", "0.20 (ttft<=250ms)"),
        ("prefill (2):", "200.00"),
        ("store:", "2"),
    ):
        assert f"\n{name:<40}{value}\n" in text, (name, value, text)
    assert "#4 HTTP 503: unavailable" in text
    assert schema.load(schema.dump(result)) == result


def test_parse_timeline_stage_wall_times_and_ec_sources():
    def stage(name, start, end=None):
        return {
            "name": name,
            "service": "x",
            "detail": "",
            "start_s": start,
            "end_s": end,
            "duration_s": None if end is None else end - start,
        }

    doc = {
        "timeline": {
            "stages": [
                stage("received", 0.0),
                stage("image intake", 0.0, 0.010),
                stage("encode", 0.02, 0.05),
                stage("encode", 0.04, 0.08),
                stage("encode", 0.1, 0.12),  # union 0.08
                stage("EC loaded from store", 0.2, 0.25),
                stage("EC loaded from store", 0.2, 0.25),
                stage("prefill", 0.25, 0.4),
                stage("first token", 0.4),
                stage("done", 0.6),
            ]
        },
        "case": {
            "request_id": "r1",
            "messages": [
                {"kind": "token_chunk", "message": {"request_id": "r1"}},
                {
                    "kind": "final_result",
                    "message": {"request_id": "r1", "ec_sources": {"h1": "store", "h2": "local_cache"}},
                },
                # another request's result in the case (a deduplicated encode's owner): not ours
                {"kind": "final_result", "message": {"request_id": "other", "ec_sources": {"zz": "store"}}},
            ],
        },
    }
    stages, sources = runner.parse_timeline(doc)
    assert stages == pytest.approx(
        {"image intake": 0.010, "encode": 0.08, "EC loaded from store": 0.05, "prefill": 0.15}
    )
    assert sources == {"h1": "store", "h2": "local_cache"}
    # E|P|D: the decode job carries them when the final result has none.
    doc["case"]["messages"] = [
        {"kind": "decode_job", "message": {"request_id": "r1", "ec_sources": {"h": "store"}}},
        {"kind": "final_result", "message": {"request_id": "r1", "ec_sources": {}}},
    ]
    assert runner.parse_timeline(doc)[1] == {"h": "store"}
    assert runner.parse_timeline({}) == ({}, {})


# -- end to end -----------------------------------------------------------------------------------
E2E = dict(
    requests=6,
    concurrency=2,
    output_tokens=(8, 8),
    prompt_words=(4, 8),
    image_sizes={"64x64": 1.0},
    repeat_share=0.5,
    text_only_share=0.2,
)


def _e2e_seed() -> int:
    """The first seed whose 6 requests have one text-only and one repeat request (and images)."""
    for seed in range(1000, 2000):
        kinds = [r.kind for r in workload.plan(spec(seed=seed, **E2E))]
        if kinds.count("text") == 1 and kinds.count("repeat") == 1:
            return seed
    raise AssertionError("no seed with the wanted mix")


@pytest.mark.slow
def test_bench_run_against_a_stack(epd_stack, tmp_path):
    seed = _e2e_seed()
    planned = workload.plan(spec(seed=seed, **E2E))
    out = tmp_path / "result.json"
    proc = epd_cli(
        {},
        "bench",
        "run",
        "--url",
        epd_stack.url,
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--output-tokens",
        "8",
        "--prompt-words",
        "4,8",
        "--image-sizes",
        "64x64",
        "--repeat-share",
        "0.5",
        "--text-only-share",
        "0.2",
        "--seed",
        str(seed),
        "--slo",
        "ttft=600000,tpot=600000",
        "--label",
        "e2e",
        "--out",
        str(out),
        "--no-progress",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "EC sources" in proc.stdout, proc.stdout

    raw = out.read_bytes()
    result = schema.load(raw)
    assert schema.dump(result) == raw
    assert result.epd is True and result.model == "qwen2-vl-tiny" and result.label == "e2e"
    assert result.spec.seed == seed and len(result.runs) == 1
    run = result.runs[0]
    assert run.concurrency == 2 and run.rate is None
    recs = run.requests
    assert [(r.index, r.kind, r.images) for r in recs] == [(p.index, p.kind, len(p.images)) for p in planned]
    for r in recs:
        assert r.ok and r.status == 200 and not r.error, r
        assert r.request_id.startswith("chatcmpl-")
        assert r.output_tokens == 8 and r.prompt_tokens > 0
        assert 0 < r.ttft_s <= r.e2e_s and 1 <= len(r.itl_s) <= 7
        assert r.stages.get("prefill", 0) > 0 and r.stages.get("decode", 0) > 0, r.stages
        # The exclusive times partition the timeline: only its stages (and "untracked"), and at
        # least the prefill and decode, which do not overlap each other.
        assert set(r.exclusive_stages) <= set(r.stages) | {schema.UNTRACKED}, (r.exclusive_stages, r.stages)
        assert sum(r.exclusive_stages.values()) >= r.stages["prefill"] + r.stages["decode"] - 1e-6, r
        if r.images:
            assert EC_STAGES & set(r.stages), r.stages
            assert "image intake" in r.stages, r.stages
            assert len(r.ec_sources) == len({im.id for im in planned[r.index].images}), r.ec_sources
        else:
            assert not r.ec_sources and not EC_STAGES & set(r.stages), r
    s = run.summary
    assert (s.completed, s.failed) == (6, 0)
    assert sum(s.ec_counts.values()) == sum(len(r.ec_sources) for r in recs) >= 4
    assert s.goodput == pytest.approx(s.request_throughput)
    assert s.ttft_ms is not None and s.tpot_ms is not None and "prefill" in s.stage_means_s
    assert sum(s.exclusive_stage_means_s.values()) == pytest.approx(
        sum(sum(r.exclusive_stages.values()) for r in recs) / len(recs)
    )
    assert report.summarize(recs, s.duration_s, s.slo_ms) == s


@pytest.mark.slow
def test_bench_records_refused_requests(epd_stack):
    """A request the server refuses is a failed record with its status and error; `run` does not raise."""
    s = spec(requests=2, concurrency=2, output_tokens=(4, 4), image_sizes={"64x64": 1.0}, model="no-such-model")
    result = asyncio.run(runner.run(epd_stack.url, s, progress=False))
    recs = result.runs[0].requests
    assert [r.ok for r in recs] == [False, False]
    assert {r.status for r in recs} == {404} and all("no-such-model" in r.error for r in recs), recs
    assert result.runs[0].summary.completed == 0
    # The CLI says so with exit code 1, and 2 when the endpoint cannot be reached at all.
    proc = epd_cli(
        {},
        "bench",
        "run",
        "--url",
        epd_stack.url,
        "--requests",
        "1",
        "--model",
        "no-such-model",
        "--output-tokens",
        "2",
        "--text-only-share",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 1 and f"\n{'Failed requests:':<40}1\n" in proc.stdout, proc.stdout
    dead = epd_cli({}, "bench", "run", "--url", "http://127.0.0.1:9", "--requests", "1", "--no-progress")
    assert dead.returncode == 2 and "cannot list the served models" in dead.stderr, dead.stderr


def test_the_lean_client_streams_reuses_its_connection_and_refuses_what_is_not_http(epd_stack):
    """``LeanClient`` (what P5 times requests with): a streamed chat completion arrives line by
    line, an error response's body is returned, the one connection serves request after request;
    a reply that is not HTTP is an error and drops the connection."""
    from shared.tools.bench.lean_http import LeanClient

    body = {
        "model": "qwen2-vl-tiny",
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "temperature": 0,
        "max_tokens": 5,
        "ignore_eos": True,
        "return_token_ids": True,
    }

    async def not_http(reader, writer):
        await reader.read(1)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main():
        lean = LeanClient(epd_stack.url)
        lines: list[str] = []
        ok = await lean.post("/v1/chat/completions", body, lines.append)
        connection = lean._writer
        refused = await lean.post("/v1/chat/completions", {**body, "model": "no-such-model"}, lines.append)
        again: list[str] = []
        await lean.post("/v1/chat/completions", body, again.append)
        reused = lean._writer is connection
        await lean.aclose()
        server = await asyncio.start_server(not_http, "127.0.0.1", 0)
        other = LeanClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        with pytest.raises(ValueError, match="not an HTTP"):
            await other.post("/v1/chat/completions", body, lines.append)
        server.close()
        return ok, lines, refused, again, reused, other._writer

    ok, lines, refused, again, reused, dropped = asyncio.run(main())
    events = [line for line in lines if line.startswith("data: ")]
    ids = [i for e in events[:-1] for c in json.loads(e[6:]).get("choices", ()) for i in c.get("token_ids") or ()]
    assert ok.status == 200 and ok.headers["x-request-id"].startswith("chatcmpl-") and ok.body == b""
    assert events[-1] == "data: [DONE]" and len(ids) == 5
    assert refused.status == 404 and "no-such-model" in json.loads(refused.body)["error"]["message"]
    assert [line for line in again if line.startswith("data: ")][-1] == "data: [DONE]" and reused
    assert dropped is None
