"""``epd bench compare`` (ratios, plots) and ``epd plan`` (queueing model) on synthetic results:
pure logic, no service processes. Expected figures are computed by hand in the comments."""

from __future__ import annotations

import json
import math
import re

import pytest
from PIL import Image

from shared.tools.bench import compare, plan
from shared.tools.bench.schema import BenchResult, LatencyStats, RequestRecord, RunResult, Summary, WorkloadSpec, dump
from shared.tools.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def stats(mean: float, median: float, p90: float, p99: float) -> LatencyStats:
    return LatencyStats(mean=mean, median=median, p90=p90, p99=p99)


def summary(
    *,
    rps: float,
    tok: float,
    ttft: LatencyStats,
    e2e: LatencyStats | None = None,
    goodput: float | None = None,
    stage_means: dict[str, float] | None = None,
) -> Summary:
    return Summary(
        completed=10,
        failed=0,
        duration_s=5.0,
        request_throughput=rps,
        output_token_throughput=tok,
        total_token_throughput=tok * 2,
        ttft_ms=ttft,
        tpot_ms=stats(10, 10, 12, 14),
        itl_ms=None,
        e2e_ms=e2e or stats(400, 380, 500, 600),
        goodput=goodput,
        stage_means_s=stage_means or {},
    )


def record(
    i: int,
    *,
    ttft: float | None,
    e2e: float | None,
    ok: bool = True,
    images: int = 1,
    output_tokens: int = 20,
    stages: dict[str, float] | None = None,
    videos: int = 0,
) -> RequestRecord:
    return RequestRecord(
        index=i,
        kind="video" if videos else "image" if images else "text",
        images=images,
        videos=videos,
        sent_at=0.1 * i,
        ok=ok,
        status=200 if ok else 503,
        output_tokens=output_tokens,
        ttft_s=ttft,
        e2e_s=e2e,
        stages=stages or {},
    )


def run_at(
    rate: float | None, summ: Summary, records: tuple[RequestRecord, ...] = (), concurrency: int | None = None
) -> RunResult:
    return RunResult(rate=rate, concurrency=concurrency, requests=records, summary=summ)


def result(
    label: str, runs: tuple[RunResult, ...], *, epd: bool = True, spec: WorkloadSpec | None = None
) -> BenchResult:
    return BenchResult(
        label=label,
        url="http://127.0.0.1:1",
        model="tiny",
        epd=epd,
        started_at=0.0,
        machine="test",
        spec=spec or WorkloadSpec(),
        runs=runs,
    )


# -- compare ---------------------------------------------------------------------------------------
def two_point_results() -> tuple[BenchResult, BenchResult, BenchResult]:
    """A (epd) at rates 1 and 2; B (epd) at rates 2 and 1 (listed the other way round); C (not
    epd) two concurrency runs, matched to A's by order."""
    a_recs = (
        record(0, ttft=0.1, e2e=0.4),
        record(1, ttft=0.3, e2e=0.2),
        record(2, ttft=None, e2e=None, ok=False),
        record(3, ttft=0.2, e2e=0.6),
    )
    a1 = run_at(
        1.0,
        summary(
            rps=2.0, tok=64.0, ttft=stats(100, 90, 150, 200), goodput=1.0, stage_means={"prefill": 0.4, "encode": 0.2}
        ),
        a_recs,
    )
    a2 = run_at(
        2.0,
        summary(
            rps=4.0, tok=128.0, ttft=stats(200, 180, 300, 400), goodput=2.0, stage_means={"prefill": 0.5, "encode": 0.3}
        ),
        a_recs[:2],
    )
    b1 = run_at(
        1.0,
        summary(
            rps=3.0,
            tok=16.0,
            ttft=stats(50, 45, 75, 250),
            goodput=0.25,
            stage_means={"encode": 0.1, "prefill": 0.1, "decode": 0.5},
        ),
        (record(0, ttft=0.05, e2e=0.1),),
    )
    b2 = run_at(
        2.0,
        summary(
            rps=2.0,
            tok=256.0,
            ttft=stats(400, 360, 600, 800),
            goodput=4.0,
            stage_means={"encode": 0.15, "prefill": 1.0},
        ),
        (record(0, ttft=0.4, e2e=0.5),),
    )
    # A stage mean in a non-epd result (a hand-edited file, say) is neither compared nor drawn.
    c1 = run_at(
        None,
        summary(rps=1.0, tok=32.0, ttft=stats(25, 45, 150, 50), stage_means={"encode": 9.0}),
        (record(0, ttft=0.02, e2e=0.3),),
        concurrency=1,
    )
    c2 = run_at(
        None, summary(rps=8.0, tok=32.0, ttft=stats(200, 180, 300, 400)), (record(0, ttft=0.2, e2e=0.3),), concurrency=4
    )
    return (result("A", (a1, a2)), result("B", (b2, b1)), result("C", (c1, c2), epd=False))


def rows(point: compare.Point) -> dict[str, compare.Row]:
    return {r.metric: r for r in point.rows}


def test_compare_ratios_are_exact_and_points_match_by_rate_then_order():
    a, b, c = two_point_results()
    points = compare.compare([a, b, c])
    assert [p.title for p in points] == [
        "rate 1 req/s ~ concurrency 1 (by order)",
        "rate 2 req/s ~ concurrency 4 (by order)",
    ]
    # Rates matched by key although B lists them the other way round; C by order.
    assert [run.rate for run in points[0].runs] == [1.0, 1.0, None]
    assert [run.concurrency for run in points[1].runs] == [None, None, 4]
    r = rows(points[0])
    assert r["request throughput (req/s)"].values == (2.0, 3.0, 1.0)
    assert r["request throughput (req/s)"].ratios == (1.5, 0.5)
    assert r["output token throughput (tok/s)"].ratios == (0.25, 0.5)
    assert r["TTFT mean (ms)"].ratios == (0.5, 0.25)
    assert r["TTFT median (ms)"].ratios == (0.5, 0.5)
    assert r["TTFT p90 (ms)"].ratios == (0.5, 1.0)
    assert r["TTFT p99 (ms)"].ratios == (1.25, 0.25)
    assert r["goodput (req/s)"].values == (1.0, 0.25, None) and r["goodput (req/s)"].ratios == (0.25, None)
    assert r["ITL mean (ms)"].ratios == (None, None)  # not measured anywhere: no ratio
    # Stage means of the epd results, in the order a request meets them; C (not epd) has none.
    stage_rows = [m for m in r if m.startswith("stage ")]
    assert stage_rows == ["stage encode (ms)", "stage prefill (ms)", "stage decode (ms)"]
    assert r["stage encode (ms)"].values == (200.0, 100.0, None) and r["stage encode (ms)"].ratios == (0.5, None)
    assert r["stage prefill (ms)"].ratios == (0.25, None)
    assert r["stage decode (ms)"].values == (None, 500.0, None) and r["stage decode (ms)"].ratios == (None, None)
    r2 = rows(points[1])
    assert r2["request throughput (req/s)"].ratios == (0.5, 2.0)
    assert r2["stage prefill (ms)"].ratios == (2.0, None)


def test_compare_matches_by_rate_when_every_result_shares_the_points():
    a, b, _ = two_point_results()
    points = compare.compare([a, b])
    assert [p.title for p in points] == ["rate 1 req/s", "rate 2 req/s"]
    assert rows(points[1])["TTFT mean (ms)"].ratios == (2.0,)


def table_line(text: str, metric: str, section: str) -> list[str]:
    block = text.split(f"== {section} ==")[1].split("==")[0]
    line = next(ln for ln in block.splitlines() if ln.startswith(metric))
    return line[len(metric) :].split()


def test_compare_cli_prints_ratios_and_writes_pngs_with_expected_series(tmp_path, capsys):
    files = []
    for res, label in zip(two_point_results(), ("base run", "new run", "vllm")):
        files.append(tmp_path / f"{res.label}.json")
        files[-1].write_bytes(dump(msgspec_replace(res, label=label)))
    plots = tmp_path / "plots"
    assert main(["bench", "compare", *map(str, files), "--plots", str(plots)]) == 0
    out = capsys.readouterr().out
    # Each point's table: the metrics where higher is better, then those where lower is; the
    # ratio columns' headers say which.
    headers = [ln for ln in out.splitlines() if ln.startswith("metric")]
    assert [re.split(r"\s{2,}", h.strip()) for h in headers[:2]] == [
        ["metric", "A", "B", "B/A (higher is better)", "C", "C/A (higher is better)"],
        ["metric", "A", "B", "B/A (lower is better)", "C", "C/A (lower is better)"],
    ]
    assert compare.better("request throughput (req/s)") == compare.better("goodput (req/s)") == "higher"
    assert compare.better("TTFT p90 (ms)") == compare.better("failed") == compare.better("stage encode (ms)") == "lower"
    assert out.splitlines()[:3] == [
        f"{key} = {label}: http://127.0.0.1:1  model tiny  {kind}  (2 run(s); test)"
        for key, label, kind in (
            ("A", "base run", "epd-serve"),
            ("B", "new run", "epd-serve"),
            ("C", "vllm", "other server"),
        )
    ]
    first, second = "rate 1 req/s ~ concurrency 1 (by order)", "rate 2 req/s ~ concurrency 4 (by order)"
    assert table_line(out, "TTFT mean (ms)", first) == ["100", "50", "0.500x", "25", "0.250x"]
    assert table_line(out, "request throughput (req/s)", second) == ["4", "2", "0.500x", "8", "2.000x"]
    assert table_line(out, "stage encode (ms)", first) == ["200", "100", "0.500x", "-", "-"]

    for name in ("latency_cdf.png", "ttft_vs_rate.png", "stage_breakdown.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        with Image.open(plots / name) as img:
            img.verify()
        assert f"wrote {plots / name}" in out


def test_plots_draw_the_expected_series(tmp_path):
    a, b, c = two_point_results()
    labels = ["A", "B", "C"]
    cdf = compare.plot_latency_cdfs([a, b, c], labels, tmp_path / "cdf.png")
    assert cdf.labels("TTFT CDF") == [
        "A @ rate 1 req/s",
        "A @ rate 2 req/s",
        "B @ rate 2 req/s",
        "B @ rate 1 req/s",
        "C @ concurrency 1",
        "C @ concurrency 4",
    ]
    # A's first run: the failed request is left out; sorted ms against (i + 1) / n, from 0.
    assert cdf.axes["TTFT CDF"]["A @ rate 1 req/s"] == (
        pytest.approx([100.0, 100.0, 200.0, 300.0]),
        pytest.approx([0.0, 1 / 3, 2 / 3, 1.0]),
    )
    assert cdf.axes["E2E CDF"]["A @ rate 1 req/s"] == (
        pytest.approx([200.0, 200.0, 400.0, 600.0]),
        pytest.approx([0.0, 1 / 3, 2 / 3, 1.0]),
    )
    assert cdf.axes["TTFT CDF"]["B @ rate 1 req/s"] == (pytest.approx([50.0, 50.0]), [0.0, 1.0])

    rate = compare.plot_ttft_vs_rate([a, b, c], labels, tmp_path / "rate.png")
    series = rate.axes["TTFT vs rate"]
    assert list(series) == ["A median", "A p90", "B median", "B p90", "C median", "C p90"]
    assert series["A median"] == ([1.0, 2.0], [90.0, 180.0])
    assert series["B p90"] == ([1.0, 2.0], [75.0, 600.0])  # sorted by rate, not by run order
    assert series["C median"] == ([1.0, 8.0], [45.0, 180.0])  # concurrency runs: measured req/s

    bars = compare.plot_stage_breakdown([a, b, c], labels, tmp_path / "stages.png")
    drawn = bars.axes["stage ms per request (epd-serve)"]  # in ms, like the tables and the other plots
    assert list(drawn) == ["encode", "prefill", "decode"]  # C is not epd-serve: no bar
    assert drawn["encode"] == ([0.0, 1.0, 2.0, 3.0], pytest.approx([200.0, 300.0, 150.0, 100.0]))
    assert drawn["decode"] == ([0.0, 1.0, 2.0, 3.0], pytest.approx([0.0, 0.0, 0.0, 500.0]))
    assert bars.xlabels["stage ms per request (epd-serve)"].startswith("ms per request")
    for p in (cdf, rate, bars):
        assert p.path.read_bytes().startswith(PNG_SIGNATURE)


def test_stage_bars_add_up_to_a_mean_request(tmp_path):
    recs = (
        record(0, ttft=0.1, e2e=0.5, stages={"encode": 0.2, "prefill": 0.1}),
        record(1, ttft=0.1, e2e=0.5, stages={"prefill": 0.3, "EC recomputed locally": 30.0}),
        record(2, ttft=None, e2e=None, ok=False, stages={"encode": 5.0}),
    )
    run = run_at(
        1.0,
        summary(
            rps=1.0,
            tok=1.0,
            ttft=stats(1, 1, 1, 1),
            stage_means={"encode": 0.2, "prefill": 0.2, "EC recomputed locally": 30.0},
        ),
        recs,
    )
    # Per completed request: encode 0.2 / 2, prefill 0.4 / 2, the one 30 s recompute / 2.
    assert compare.stage_seconds_per_request(run) == pytest.approx(
        {"encode": 0.1, "prefill": 0.2, "EC recomputed locally": 15.0}
    )
    drawn = compare.plot_stage_breakdown([result("X", (run,))], ["X"], tmp_path / "s.png").axes
    assert drawn["stage ms per request (epd-serve)"] == {
        "encode": ([0.0], pytest.approx([100.0])),
        "EC recomputed locally": ([0.0], pytest.approx([15000.0])),
        "prefill": ([0.0], pytest.approx([200.0])),
    }


def test_single_point_results_skip_the_rate_plot_and_non_epd_the_stage_bars(tmp_path):
    one = run_at(2.0, summary(rps=2.0, tok=1.0, ttft=stats(1, 1, 1, 1)), (record(0, ttft=0.1, e2e=0.2),))
    written = compare.write_plots(
        [result("X", (one,), epd=False), result("Y", (one,), epd=False)], ["X", "Y"], tmp_path
    )
    assert [p.path.name for p in written] == ["latency_cdf.png"]
    assert written[0].labels("TTFT CDF") == ["X", "Y"]


@pytest.mark.parametrize("content", [b"{not json", b'{"label": "x"}', json.dumps({"schema": 1}).encode()])
def test_compare_refuses_files_that_are_not_bench_results(tmp_path, capsys, content):
    good = tmp_path / "good.json"
    good.write_bytes(dump(two_point_results()[0]))
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert main(["bench", "compare", str(good), str(bad)]) == compare.EXIT_ERROR
    err = capsys.readouterr().err
    assert "bad.json: not a bench result" in err
    assert main(["bench", "compare", str(good), str(tmp_path / "missing.json")]) == compare.EXIT_ERROR
    assert "missing.json" in capsys.readouterr().err


def test_duplicate_labels_are_told_apart(tmp_path):
    a, b, _ = two_point_results()
    same = [a, result("A", b.runs)]
    assert compare.labels_of(same, [tmp_path / "x.json", tmp_path / "y.json"]) == ["A (x.json)", "A (y.json)"]


# -- plan: queueing --------------------------------------------------------------------------------
def erlang_c_by_factorials(c: int, a: float) -> float:
    top = a**c / math.factorial(c) * c / (c - a)
    return top / (sum(a**k / math.factorial(k) for k in range(c)) + top)


def test_erlang_c_matches_hand_values_and_the_closed_form():
    # M/M/2, a = 1 (rho 0.5): P(wait) = 2 rho^2 / (1 + rho) = 1/3; Wq = C S / (c - a) = 1/3 s.
    assert plan.erlang_c(2, 1.0) == pytest.approx(1 / 3, rel=1e-12)
    assert plan.mmc_wait(1.0, 1.0, 2) == pytest.approx(1 / 3, rel=1e-12)
    # M/M/3, a = 1: (1/6 * 3/2) / (1 + 1 + 1/2 + 1/4) = 1/11; Wq = (1/11) / 2 = 1/22 s.
    assert plan.erlang_c(3, 1.0) == pytest.approx(1 / 11, rel=1e-12)
    assert plan.mmc_wait(1.0, 1.0, 3) == pytest.approx(1 / 22, rel=1e-12)
    # M/M/1: C = rho, Wq = rho S / (1 - rho).
    assert plan.mmc_wait(0.5, 1.0, 1) == pytest.approx(1.0, rel=1e-12)
    for c, a in ((1, 0.3), (4, 2.5), (7, 6.9), (13, 10.0), (40, 31.0)):
        assert plan.erlang_c(c, a) == pytest.approx(erlang_c_by_factorials(c, a), rel=1e-9)
    assert plan.erlang_c(2, 2.0) == 1.0 and math.isinf(plan.mmc_wait(2.0, 1.0, 2))
    assert plan.erlang_c(3, 0.0) == 0.0


BRIEF = plan.StageCosts(encode_s=0.2, prefill_s=0.3, decode_s_per_token=0.05)
ONE_IMAGE_20_TOKENS = plan.Mix(cold_images=1.0, output_tokens=20)


def test_plan_counts_by_utilisation_are_the_hand_computed_ones():
    # rate 10, rho <= 0.8: E = ceil(10 x 0.2 / 0.8) = ceil(2.5) = 3; P = ceil(3.75) = 4;
    # D = ceil(10 x 0.05 x 20 / 0.8) = ceil(12.5) = 13.
    p = plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 10.0, "e-p-d")
    assert p.counts == {"encoder": 3, "prefill": 4, "decode": 13} and p.ratio == "3:4:13"
    assert p.role("decode").utilisation == pytest.approx(10.0 / 13)
    assert p.bottleneck.role == "decode" and p.feasible
    # E|PD: PD serves prefill + decode = 1.3 s -> ceil(16.25) = 17.  Agg: 1.5 s -> ceil(18.75) = 19.
    assert plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 10.0, "e-pd").counts == {"encoder": 3, "pd": 17}
    assert plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 10.0, "agg").counts == {"agg": 19}
    # Two cold images per request double the encode jobs: ceil(20 x 0.2 / 0.8) = 5.
    assert plan.make_plan(BRIEF, plan.Mix(cold_images=2.0, output_tokens=20), 10.0, "e-p-d").counts["encoder"] == 5
    # The KV hand-off is prefill-worker time: (0.3 + 0.1) x 10 / 0.8 = 5.
    handoff = plan.StageCosts(encode_s=0.2, prefill_s=0.3, decode_s_per_token=0.05, handoff_s=0.1)
    assert plan.make_plan(handoff, ONE_IMAGE_20_TOKENS, 10.0, "e-p-d").counts["prefill"] == 5
    # Exactly at the target is allowed, float noise aside: 6 x 0.1 / 0.6 = 1.0000000000000002 -> 1.
    assert 6 * 0.1 / 0.6 > 1 and plan.min_workers(6.0, 0.1, 0.6) == 1
    assert plan.min_workers(6.0, 0.1001, 0.6) == 2
    # 4 x 0.2 / 0.8 = 1 exactly; a lower target needs more.
    assert plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 4.0, "e-p-d").counts["encoder"] == 1
    assert plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 4.0, "e-p-d", target=0.5).counts["encoder"] == 2
    # The prefill side loads every image, cold or not: 10 x (0.3 + 2 x 0.1) / 0.8 = 6.25 -> 7.
    loads = plan.StageCosts(encode_s=0.2, prefill_s=0.3, decode_s_per_token=0.05, ec_load_s=0.1)
    assert plan.make_plan(loads, plan.Mix(cold_images=0.5, output_tokens=20, images=2.0), 10.0, "e-p-d").counts == {
        "encoder": 2,
        "prefill": 7,
        "decode": 13,
    }
    # Nothing to encode: still one encoder (images outside the mix), and a note says so.
    text = plan.make_plan(BRIEF, plan.Mix(cold_images=0.0, output_tokens=20), 10.0, "e-pd")
    assert text.counts["encoder"] == 1 and any("no cold images" in n for n in text.notes)


PD_ONLY = plan.StageCosts(encode_s=0.0, prefill_s=0.5, decode_s_per_token=0.025)
NO_IMAGES = plan.Mix(cold_images=0.0, output_tokens=20)


def test_plan_adds_workers_for_the_ttft_slo_by_erlang_c():
    # E|PD, 1 req/s, PD service 0.5 + 0.025 x 20 = 1.0 s; utilisation alone: ceil(1 / 0.8) = 2.
    # TTFT = PD wait + prefill: with 2 workers 1/3 + 0.5 = 0.833 s; with 3: 1/22 + 0.5 = 0.545 s.
    assert plan.make_plan(PD_ONLY, NO_IMAGES, 1.0, "e-pd", slo_ms={"ttft": 900}).counts["pd"] == 2
    p = plan.make_plan(PD_ONLY, NO_IMAGES, 1.0, "e-pd", slo_ms={"ttft": 600})
    assert p.counts["pd"] == 3 and p.feasible
    assert p.role("pd").wait_s == pytest.approx(1 / 22)
    assert any("-> 3 workers" in why for why in p.role("pd").why)
    # Below the service time on the path (0.5 s) no count helps: infeasible, counts by utilisation.
    bad = plan.make_plan(PD_ONLY, NO_IMAGES, 1.0, "e-pd", slo_ms={"ttft": 450})
    assert not bad.feasible and bad.counts["pd"] == 2 and "cannot be met" in bad.notes[0]
    # Exactly the service time: only infinitely many workers would do (no wait at all).
    edge = plan.make_plan(PD_ONLY, NO_IMAGES, 1.0, "e-pd", slo_ms={"ttft": 500})
    assert not edge.feasible and "cannot be met by adding workers" in edge.notes[0] and edge.counts["pd"] == 2


def test_plan_shares_the_ttft_bound_between_encoder_and_prefill():
    # E|P|D, 1 req/s, encode 1.0 s/image, prefill 1.0 s: each gets half of TTFT 2.6 s = 1.3 s.
    # Utilisation: 2 each. Wait + service with 2: 1/3 + 1 = 1.333 > 1.3 -> 3 (1/22 + 1 = 1.045).
    costs = plan.StageCosts(encode_s=1.0, prefill_s=1.0, decode_s_per_token=0.01)
    p = plan.make_plan(costs, plan.Mix(cold_images=1.0, output_tokens=10), 1.0, "e-p-d", slo_ms={"ttft": 2600})
    assert p.counts == {"encoder": 3, "prefill": 3, "decode": 1}
    # 2.7 s: shares 1.35 s, 2 workers each fit.
    p = plan.make_plan(costs, plan.Mix(cold_images=1.0, output_tokens=10), 1.0, "e-p-d", slo_ms={"ttft": 2700})
    assert p.counts == {"encoder": 2, "prefill": 2, "decode": 1}
    # Shares follow the service times: encode 0.5 s, prefill 1.0 s, TTFT 2.1 s -> 0.7 s and 1.4 s.
    # Encoder (a = 0.5): 1 worker waits rho S / (1 - rho) = 0.5 s -> 1.0 s > 0.7; 2 workers: C = 2 rho^2 /
    # (1 + rho) = 0.1 (rho 0.25), wait 0.1 x 0.5 / 1.5 = 0.033 s -> 0.533 s. Prefill: 2 workers 1.333 s <= 1.4.
    # (Equal shares, 1.05 s each, would give 1 encoder and 3 prefill workers.)
    costs = plan.StageCosts(encode_s=0.5, prefill_s=1.0, decode_s_per_token=0.01)
    p = plan.make_plan(costs, plan.Mix(cold_images=1.0, output_tokens=10), 1.0, "e-p-d", slo_ms={"ttft": 2100})
    assert p.counts == {"encoder": 2, "prefill": 2, "decode": 1}
    assert p.role("encoder").wait_s == pytest.approx(0.1 * 0.5 / 1.5)


def test_plan_tpot_slo_sizes_the_decode_queue_in_e_p_d_only():
    # E|P|D decode: 1.0 s per request (0.05 x 20) at 1 req/s -> 2 by utilisation; TPOT =
    # (wait + 1.0) / 20: 2 workers 66.7 ms, 3 workers 52.3 ms.
    costs = plan.StageCosts(encode_s=0.0, prefill_s=0.1, decode_s_per_token=0.05)
    assert plan.make_plan(costs, NO_IMAGES, 1.0, "e-p-d", slo_ms={"tpot": 70}).counts["decode"] == 2
    assert plan.make_plan(costs, NO_IMAGES, 1.0, "e-p-d", slo_ms={"tpot": 60}).counts["decode"] == 3
    # E|PD decodes right after its prefill (no queue): 50 ms/token fits 60 with the utilisation count
    # (ceil(1.1 / 0.8) = 2), misses 40 whatever the count.
    fits = plan.make_plan(costs, NO_IMAGES, 1.0, "e-pd", slo_ms={"tpot": 60})
    assert fits.feasible and fits.counts["pd"] == 2 and any("no queue" in w for w in fits.role("pd").why)
    miss = plan.make_plan(costs, NO_IMAGES, 1.0, "e-pd", slo_ms={"tpot": 40})
    assert not miss.feasible and miss.counts["pd"] == 2


def test_plan_refuses_bad_targets():
    with pytest.raises(plan.PlanError, match="rate"):
        plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 0.0)
    for target in (0.0, 1.0, 1.5):
        with pytest.raises(plan.PlanError, match="target"):
            plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 1.0, target=target)
    with pytest.raises(plan.PlanError, match="topology"):
        plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 1.0, "e-e-e")


# -- plan: measured costs and workload mix ----------------------------------------------------------
def measured_records() -> tuple[RequestRecord, ...]:
    return (
        # single-image requests: encode + EC stored = 0.21 and 0.19 -> 0.2 s per image; their loads
        # include waiting for that encode (not prefill-side work)
        record(
            0,
            ttft=0.5,
            e2e=1.5,
            stages={"encode": 0.2, "EC stored": 0.01, "EC loaded from store": 0.25, "prefill": 0.3, "decode": 1.0},
        ),
        record(
            1,
            ttft=0.5,
            e2e=1.5,
            stages={
                "encode": 0.18,
                "EC stored": 0.01,
                "EC loaded from store": 0.2,
                "prefill": 0.3,
                "decode": 0.8,
                "KV hand-off": 0.02,
            },
        ),
        # two images encoded in parallel (the union of the spans): not used while singles exist
        record(
            2,
            ttft=0.5,
            e2e=1.5,
            images=2,
            stages={"encode": 0.25, "EC loaded from store": 0.3, "prefill": 0.3, "decode": 1.2},
        ),
        record(3, ttft=None, e2e=None, ok=False, stages={"encode": 9.0, "prefill": 9.0, "decode": 9.0}),
        # repeats: pure loads, 0.02 + 0.04 s for 3 images -> 0.02 s per image
        record(4, ttft=0.5, e2e=1.5, stages={"EC from local cache": 0.02, "prefill": 0.3, "decode": 1.0}),
        record(5, ttft=0.5, e2e=1.5, images=2, stages={"EC loaded from store": 0.04, "prefill": 0.3, "decode": 1.0}),
        # a recompute after EPD_EC_WAIT_S (the other image's load shares its span): not a load
        record(
            6,
            ttft=30.5,
            e2e=31.5,
            images=2,
            stages={"EC recomputed locally": 30.0, "EC loaded from store": 30.0, "prefill": 0.3, "decode": 1.0},
        ),
    )


def test_costs_from_a_result_are_the_stage_means():
    res = result("m", (run_at(1.0, summary(rps=1, tok=1, ttft=stats(1, 1, 1, 1)), measured_records()),))
    c = plan.costs_from_result(res)
    assert c.encode_s == pytest.approx(0.2)  # (0.21 + 0.19) / 2 images
    assert c.prefill_s == pytest.approx(0.3)
    assert c.ec_load_s == pytest.approx(0.02)  # (0.02 + 0.04) / 3 images
    assert c.decode_s_per_token == pytest.approx(6.0 / 120)  # (1.0 + 0.8 + 1.2 + 3 x 1.0) s / 6 x 20 tokens
    assert c.handoff_s == pytest.approx(0.02)
    # Without pure loads: the loads minus the encoder stages they waited for, (0.04 + 0.01) / 2.
    assert plan.costs_from_records(list(measured_records()[:2])).ec_load_s == pytest.approx(0.025)
    with pytest.raises(plan.PlanError, match="not an epd-serve result"):
        plan.costs_from_result(result("x", res.runs, epd=False))
    with pytest.raises(plan.PlanError, match="no completed request with stage timings"):
        plan.costs_from_records([record(0, ttft=0.1, e2e=0.2)])
    with pytest.raises(plan.PlanError, match="no run 3"):
        plan.costs_from_result(res, run_index=3)
    observed = plan.mix_from_records(list(measured_records()))
    assert observed == plan.Mix(cold_images=4 / 6, output_tokens=20, images=9 / 6)  # r0, r1, r2 encoded


def test_mix_from_the_workload_spec():
    spec = WorkloadSpec(
        images_per_request={1: 0.5, 3: 0.5}, text_only_share=0.25, repeat_share=0.5, output_tokens=(10, 30)
    )
    m = plan.mix_from_spec(spec)
    assert m.cold_images == pytest.approx(2 * 0.75 * 0.5) and m.output_tokens == 20
    assert m.all_images == pytest.approx(2 * 0.75)
    # Turns after the first ask about the same images: a conversation is 0.25 + 0.75 x 2 requests.
    m = plan.mix_from_spec(msgspec_replace(spec, turns=2))
    assert m.cold_images == pytest.approx(2 * 0.75 * 0.5 / 1.75)
    assert m.all_images == pytest.approx(2 * 0.75 * 2 / 1.75)  # every turn carries the images
    given = plan.mix_from_spec(spec, images=1, repeat_share=0, text_only_share=0, output_tokens=5)
    assert given == plan.Mix(1.0, 5, 1.0)
    with pytest.raises(plan.PlanError, match="repeat share"):
        plan.mix_from_spec(spec, repeat_share=1.5)


def msgspec_replace(spec: WorkloadSpec, **changes) -> WorkloadSpec:
    import msgspec

    return msgspec.structs.replace(spec, **changes)


def test_plan_cli_from_a_result_file(tmp_path, capsys):
    res = result(
        "m",
        (run_at(1.0, summary(rps=1, tok=1, ttft=stats(1, 1, 1, 1)), measured_records()),),
        spec=WorkloadSpec(output_tokens=(20, 20)),
    )
    path = tmp_path / "m.json"
    path.write_bytes(dump(res))
    # costs 0.2 s/image, prefill 0.3 s + 0.02 s EC load (one image) + 0.02 s hand-off, decode 0.05 s x 20
    # tokens at 10 req/s: E ceil(2.5) = 3, P ceil(3.4 / 0.8) = 5 (utilisation 0.68), D ceil(12.5) = 13
    # (0.77, the bottleneck). E|PD: (0.3 + 0.02 + 1.0) x 10 / 0.8 = 16.5 -> 17.
    assert main(["plan", str(path), "--rate", "10", "--topology", "e-p-d", "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["ratio"] == "3:5:13" and doc["bottleneck"] == "decode" and doc["feasible"]
    assert [r["utilisation"] for r in doc["roles"]] == pytest.approx([2 / 3, 0.68, 10 / 13])
    assert main(["plan", str(path), "--rate", "10"]) == 0
    out = capsys.readouterr().out
    assert "recommended E:PD = 3:17" in out and "recommended E:P:D = 3:5:13" in out
    assert "epd up --topology e-p-d --encoders 3 --prefills 5 --decoders 13" in out
    # An SLO below the path's service time: exit 1 and the reason.
    assert main(["plan", str(path), "--rate", "10", "--slo", "ttft=100"]) == plan.EXIT_SLO
    assert "cannot be met" in capsys.readouterr().out
    # --costs instead of a file (EC load per image on the prefill side: 10 x (0.3 + 0.05) / 0.8 = 4.375);
    # neither, or both: exit 2.
    assert (
        main(
            [
                "plan",
                "--costs",
                "encode=0.2,prefill=0.3,decode=0.05,ec_load=0.05",
                "--rate",
                "10",
                "--images",
                "1",
                "--output-tokens",
                "20",
                "--topology",
                "e-p-d",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)[0]["ratio"] == "3:5:13"
    assert (
        main(
            [
                "plan",
                "--costs",
                "encode=0.2,prefill=0.3,decode=0.05",
                "--rate",
                "10",
                "--images",
                "1",
                "--output-tokens",
                "20",
                "--topology",
                "e-p-d",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)[0]["ratio"] == "3:4:13"
    assert main(["plan", "--rate", "10"]) == plan.EXIT_ERROR
    assert main(["plan", str(path), "--from-streams", "5m", "--rate", "1"]) == plan.EXIT_ERROR
    assert main(["plan", str(path), "--costs", "encode=1,prefill=1,decode=1", "--rate", "1"]) == plan.EXIT_ERROR
    not_epd = tmp_path / "other.json"
    not_epd.write_bytes(dump(result("o", res.runs, epd=False)))
    assert main(["plan", str(not_epd), "--rate", "1"]) == plan.EXIT_ERROR
    assert "not an epd-serve result" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--costs", "encode=0.2,prefill=0.3", "--rate", "1"])  # no decode cost


# -- plan: video clips -----------------------------------------------------------------------------
VIDEO_COSTS = plan.StageCosts(
    encode_s=0.2, prefill_s=0.3, decode_s_per_token=0.05, ec_load_s=0.01, video_encode_s=1.6, video_ec_load_s=0.05
)


def test_a_video_workload_plans_more_encoders_than_the_same_with_images_only():
    # Half the media requests carry a clip, a quarter of those a clip sent before: per request 0.5
    # cold images (all of them) and 0.5 x 0.75 = 0.375 cold clips of 0.5 clips.
    spec = WorkloadSpec(video_share=0.5, video_repeat_share=0.25, output_tokens=(20, 20))
    m = plan.mix_from_spec(spec)
    assert (m.cold_images, m.all_images, m.cold_videos, m.all_videos) == pytest.approx((0.5, 0.5, 0.375, 0.5))
    images_only = plan.mix_from_spec(msgspec_replace(spec, video_share=0.0))
    assert images_only == plan.Mix(1.0, 20, 1.0)
    # E|P|D at 10 req/s. Encoder: 0.5 x 0.2 + 0.375 x 1.6 = 0.7 s per request over 0.875 jobs (0.8 s
    # each): 7 busy -> ceil(8.75) = 9 (images only: 10 x 0.2 / 0.8 -> 3). Prefill: 0.3 + 0.5 x 0.01 +
    # 0.5 x 0.05 = 0.33 s -> ceil(4.125) = 5 (images only 0.31 s -> 4). Decode 1.0 s -> 13 both.
    p = plan.make_plan(VIDEO_COSTS, m, 10.0, "e-p-d")
    assert p.counts == {"encoder": 9, "prefill": 5, "decode": 13}
    assert p.role("encoder").service_s == pytest.approx(0.8) and p.role("encoder").arrival == pytest.approx(8.75)
    assert plan.make_plan(VIDEO_COSTS, images_only, 10.0, "e-p-d").counts == {"encoder": 3, "prefill": 4, "decode": 13}
    # Agg encodes in process: 0.7 + 0.3 + 1.0 = 2.0 s -> 25 workers (images only 1.5 s -> 19).
    assert plan.make_plan(VIDEO_COSTS, m, 10.0, "agg").counts == {"agg": 25}
    assert plan.make_plan(VIDEO_COSTS, images_only, 10.0, "agg").counts == {"agg": 19}
    # A TTFT bound waits for the encoder's mean job (0.8 s), not the image's 0.2 s: 1.0 s cannot be
    # met (0.8 + prefill 0.33 on the path) where images alone could.
    assert not plan.make_plan(VIDEO_COSTS, m, 10.0, "e-p-d", slo_ms={"ttft": 1000}).feasible
    assert plan.make_plan(VIDEO_COSTS, images_only, 10.0, "e-p-d", slo_ms={"ttft": 1000}).feasible
    text = plan.format_plan(p)
    assert "video encode 1600.0 ms/clip, video EC load 50.0 ms/clip" in text
    assert "workload: 0.5 cold of 0.5 image(s), 0.375 cold of 0.5 video clip(s) and 20 output tokens" in text
    doc = p.to_json()
    assert doc["costs"]["video_encode_s"] == 1.6 and doc["mix"]["cold_videos"] == pytest.approx(0.375)


def test_the_video_mix_is_the_one_the_workload_generator_draws():
    from shared.tools.bench import workload

    spec = WorkloadSpec(
        requests=12000, text_only_share=0.2, video_share=0.4, video_repeat_share=0.25, repeat_share=0.3, turns=2
    )
    # A conversation is 0.2 + 0.8 x 2 = 1.8 requests; per request: 0.8 x 0.6 x 0.7 / 1.8 cold images of
    # 0.8 x 0.6 x 2 / 1.8, and 0.8 x 0.4 x 0.75 / 1.8 cold clips of 0.8 x 0.4 x 2 / 1.8.
    m = plan.mix_from_spec(spec)
    assert (m.cold_images, m.all_images) == pytest.approx((0.8 * 0.6 * 0.7 / 1.8, 0.8 * 0.6 * 2 / 1.8))
    assert (m.cold_videos, m.all_videos) == pytest.approx((0.8 * 0.4 * 0.75 / 1.8, 0.8 * 0.4 * 2 / 1.8))
    reqs = workload.plan(spec)
    n = len(reqs)
    # One image per image request: an "image" request's image is new; a "video" request's clip is.
    drawn = (
        sum(r.kind == "image" for r in reqs) / n,
        sum(len(r.images) for r in reqs) / n,
        sum(r.kind == "video" for r in reqs) / n,
        sum(len(r.videos) for r in reqs) / n,
    )
    # (within 2% for this seed, 3% over seeds 0-5: sampling noise; a share left out is 25-70% off)
    assert drawn == pytest.approx((m.cold_images, m.all_images, m.cold_videos, m.all_videos), rel=0.05)


def video_records() -> tuple[RequestRecord, ...]:
    return (
        # fresh clips: encode + EC stored = 1.6 and 1.4 s -> 1.5 s per clip; their loads wait for it
        record(
            10,
            ttft=2.0,
            e2e=3.0,
            images=0,
            videos=1,
            stages={"encode": 1.5, "EC stored": 0.1, "EC loaded from store": 1.7, "prefill": 0.9, "decode": 1.0},
        ),
        record(
            11,
            ttft=2.0,
            e2e=3.0,
            images=0,
            videos=1,
            stages={"encode": 1.3, "EC stored": 0.1, "EC loaded from store": 1.5, "prefill": 0.9, "decode": 1.0},
        ),
        # a clip sent before: a pure load of 0.06 s
        record(
            12,
            ttft=1.0,
            e2e=2.0,
            images=0,
            videos=1,
            stages={"EC loaded from store": 0.06, "prefill": 0.9, "decode": 1.0},
        ),
        # an image and a clip in one request: its stages cannot be split, left out of both kinds
        record(
            13,
            ttft=6.0,
            e2e=7.0,
            images=1,
            videos=1,
            stages={"encode": 5.0, "EC stored": 0.5, "EC loaded from store": 5.6, "prefill": 0.9, "decode": 1.0},
        ),
    )


def test_costs_from_records_split_per_kind_of_item():
    recs = [*measured_records(), *video_records()]
    c = plan.costs_from_records(recs)
    assert c.encode_s == pytest.approx(0.2) and c.ec_load_s == pytest.approx(0.02)  # the images' as before
    assert c.video_encode_s == pytest.approx(1.5)  # (1.6 + 1.4) / 2 clips
    assert c.video_ec_load_s == pytest.approx(0.06)
    assert c.prefill_s == pytest.approx((6 * 0.3 + 4 * 0.9) / 10)  # every completed request's
    assert c.decode_s_per_token == pytest.approx(10.0 / 200)
    assert "2 encoded images, 2 encoded video clips; 1 with both left out" in c.source
    # Without a pure clip load: the loads minus the encoder stages they waited for, (0.1 + 0.1) / 2.
    c = plan.costs_from_records([*measured_records(), *video_records()[:2]])
    assert c.video_ec_load_s == pytest.approx(0.1)
    # Only repeated clips: their load is measured, their encode is not; no clip at all: neither.
    c = plan.costs_from_records([*measured_records(), video_records()[2]])
    assert c.video_encode_s is None and c.video_ec_load_s == pytest.approx(0.06)
    c = plan.costs_from_records(list(measured_records()))
    assert (c.video_encode_s, c.video_ec_load_s) == (None, None)
    assert c.source == "records: 6 requests (2 encoded images)"
    # The observed mix: 10 completed; encoded r0, r1, r2 (4 images), two clips, the mixed one.
    observed = plan.mix_from_records(recs)
    assert observed == plan.Mix(cold_images=5 / 10, output_tokens=20, images=10 / 10, cold_videos=3 / 10, videos=4 / 10)


def test_stream_records_count_clips_from_the_media_refs():
    from types import SimpleNamespace

    from shared.protocol import ImageRef, MediaKind

    image = ImageRef(item_hash="a", media_key="k", width=1, height=1)
    clip = ImageRef(item_hash="b", media_key="", width=1, height=1, kind=MediaKind.VIDEO, frames=8, fps=2.0)
    # The summary counts both as images (history.Summary.images = the record's refs).
    case = SimpleNamespace(record=SimpleNamespace(images=(image, clip, image)), generation_job=None)
    assert plan.media_counts(case, 3) == (2, 1)
    case = SimpleNamespace(record=None, generation_job=SimpleNamespace(images=(clip,)))
    assert plan.media_counts(case, 1) == (0, 1)
    assert plan.media_counts(SimpleNamespace(record=None, generation_job=None), 2) == (2, 0)


def test_old_cost_strings_and_results_without_videos_give_the_plans_they_gave_before(tmp_path, capsys):
    # The figures epd plan printed for these inputs before it knew videos, pinned.
    spec = WorkloadSpec(
        images_per_request={1: 0.5, 3: 0.5}, repeat_share=0.3, text_only_share=0.25, turns=2, output_tokens=(10, 30)
    )
    path = tmp_path / "m.json"
    path.write_bytes(
        dump(result("m", (run_at(1.0, summary(rps=1, tok=1, ttft=stats(1, 1, 1, 1)), measured_records()),), spec=spec))
    )
    old_costs = "encode=0.13,prefill=0.31,decode=0.021,handoff=0.01,ec_load=0.007"
    mix_flags = ["--images", "2", "--repeat-share", "0.3", "--text-only-share", "0.25", "--output-tokens", "20"]
    inputs = {"costs": ["--costs", old_costs, *mix_flags], "result": [str(path)]}
    before = {
        ("costs", "e-pd"): ("2:7", [("encoder", 2, 7.875, 0.13), ("pd", 7, 7.5, 0.7405)], 738.4149948111975),
        ("costs", "e-p-d"): (
            "2:4:4",
            [("encoder", 2, 7.875, 0.13), ("prefill", 4, 7.5, 0.3305), ("decode", 4, 7.5, 0.42)],
            564.5992542189315,
        ),
        ("result", "e-pd"): (
            "2:13",
            [("encoder", 2, 4.5, 0.2), ("pd", 13, 7.5, 1.3342857142857143)],
            712.7392198038782,
        ),
        ("result", "e-p-d"): (
            "2:4:10",
            [("encoder", 2, 4.5, 0.2), ("prefill", 4, 7.5, 0.3542857142857143), ("decode", 10, 7.5, 1.0)],
            683.9907766347912,
        ),
    }
    text_before = {
        "costs": [
            "costs (--costs): encode 130.0 ms/image, prefill 310.0 ms/request, decode 21.00 ms/token, EC load 7.0 "
            "ms/image, KV hand-off 10.0 ms",
            "workload: 1.05 cold of 1.5 image(s) and 20 output tokens per request",
        ],
        "result": [
            f"costs ({path}: 6 requests (2 encoded images)): encode 200.0 ms/image, prefill 300.0 ms/request, "
            "decode 50.00 ms/token, EC load 20.0 ms/image, KV hand-off 20.0 ms",
            "workload: 0.6 cold of 1.71 image(s) and 20 output tokens per request",
        ],
    }
    for (source, topology), (ratio, roles, ttft_ms) in before.items():
        args = ["plan", *inputs[source], "--rate", "7.5", "--slo", "ttft=900,tpot=80", "--topology", topology]
        assert main([*args, "--json"]) == 0
        (doc,) = json.loads(capsys.readouterr().out)
        assert doc["ratio"] == ratio
        got = [(r["role"], r["workers"], r["jobs_per_s"], r["service_s"]) for r in doc["roles"]]
        assert got == [(n, w, pytest.approx(j, rel=1e-12), pytest.approx(s, rel=1e-12)) for n, w, j, s in roles]
        assert doc["expected_ms"]["ttft"] == pytest.approx(ttft_ms, rel=1e-12)
        # The video figures are there, empty.
        assert (doc["costs"]["video_encode_s"], doc["costs"]["video_ec_load_s"]) == (None, None)
        assert (doc["mix"]["cold_videos"], doc["mix"]["videos"]) == (0.0, None)
        assert main(args) == 0
        assert capsys.readouterr().out.splitlines()[1:3] == text_before[source]


def test_plan_refuses_a_mix_with_videos_it_has_no_cost_for(tmp_path, capsys):
    old_costs = "encode=0.2,prefill=0.3,decode=0.05"
    base = ["plan", "--rate", "10", "--output-tokens", "20", "--topology", "e-p-d"]
    # Cold clips in the mix, no per-clip encode: exit 2, naming what to measure (never a plan without it).
    assert main([*base, "--costs", old_costs, "--video-share", "0.5"]) == plan.EXIT_ERROR
    err = capsys.readouterr().err
    assert "0.5 cold video clip(s) per request" in err and "no per-clip video encode" in err
    assert "epd bench run --video-share" in err and "video_encode=S" in err
    # Only repeated clips: no encode needed, but their loads are prefill time.
    assert main([*base, "--costs", old_costs, "--video-share", "0.5", "--video-repeat-share", "1"]) == plan.EXIT_ERROR
    assert "no per-clip video EC load" in capsys.readouterr().err
    # Given: 10 x (0.5 x 0.2 + 0.5 x 1.4) / 0.8 = 10 encoders; video_ec_load defaults to 0, like ec_load.
    assert main([*base, "--costs", old_costs + ",video_encode=1.4", "--video-share", "0.5", "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["roles"][0]["workers"] == 10 and doc["costs"]["video_ec_load_s"] == 0.0
    assert plan.parse_costs("encode=0,prefill=0,decode=0,video_ec_load=0.1").video_encode_s is None
    # A result whose workload had clips but no clip request among its records (a hand-made file, a
    # run whose clips all failed): refused too, not planned as if clips cost nothing.
    path = tmp_path / "v.json"
    run = run_at(1.0, summary(rps=1, tok=1, ttft=stats(1, 1, 1, 1)), measured_records())
    path.write_bytes(dump(result("v", (run,), spec=WorkloadSpec(video_share=0.3))))
    assert main(["plan", str(path), "--rate", "10"]) == plan.EXIT_ERROR
    assert f"the costs ({path}: 6 requests (2 encoded images)) have no per-clip video encode" in capsys.readouterr().err
    assert main(["plan", str(path), "--rate", "10", "--video-share", "0"]) == 0  # the images alone: planned
    with pytest.raises(plan.PlanError, match="no per-clip video encode"):
        plan.make_plan(BRIEF, plan.Mix(cold_images=1.0, output_tokens=20, cold_videos=0.1), 1.0)


# -- plan: --validate pieces (the stack run itself is checked by hand, see docs/benchmarking.md) --------------
def test_validation_scales_counts_and_rate_down_together():
    p = plan.make_plan(BRIEF, ONE_IMAGE_20_TOKENS, 10.0, "e-p-d")  # 3:4:13
    # 5 of 20 workers: factor 1/4 -> floor(0.75) -> 1 (at least one), floor(1.0) = 1, floor(3.25) = 3;
    # the rate by the smallest factor a role got: min(1/3, 1/4, 3/13) = 3/13.
    counts, rate = plan.scale_down(p, 5)
    assert counts == {"encoder": 1, "prefill": 1, "decode": 3} and rate == pytest.approx(10 * 3 / 13)
    small = plan.fixed_plan(BRIEF, ONE_IMAGE_20_TOKENS, rate, "e-p-d", counts)
    assert max(r.utilisation for r in small.roles) <= max(r.utilisation for r in p.roles) + 1e-12
    assert plan.scale_down(p, 20) == (p.counts, 10.0)  # small enough already
    spec = plan.validation_spec(
        WorkloadSpec(sweep=(1.0, 2.0), requests=None, duration_s=30.0), rate, 12, images=2, output_tokens=20
    )
    assert (spec.arrival, spec.rate, spec.sweep, spec.requests, spec.duration_s) == ("poisson", rate, (), 12, None)
    assert spec.images_per_request == {2: 1.0} and spec.output_tokens == (20, 20)


def test_validation_judges_measured_means_against_the_slo():
    p = plan.make_plan(PD_ONLY, NO_IMAGES, 1.0, "e-pd", slo_ms={"ttft": 600})
    recs = tuple(record(i, ttft=0.5, e2e=1.0, images=0, stages={"prefill": 0.5, "decode": 0.5}) for i in range(3))

    def measured(ttft_ms: float, failed: int = 0) -> BenchResult:
        summ = msgspec_replace(
            summary(rps=1.0, tok=20.0, ttft=stats(ttft_ms, ttft_ms, ttft_ms, ttft_ms)), failed=failed
        )
        return result("v", (run_at(1.0, summ, recs),))

    ok, text = plan.judge(p, p, measured(550.0))
    assert ok and "SLO held" in text and "prefill 500.0 ms" in text
    ok, text = plan.judge(p, p, measured(650.0))
    assert not ok and "MISSED" in text
    assert plan.judge(p, p, measured(550.0, failed=1))[0] is False
