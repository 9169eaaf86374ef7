"""Exclusive stage times of ``epd bench``: a partition of each request's timeline into stages.

* ``runner.exclusive_stage_times`` on a synthetic timeline with nested spans, a partial overlap,
  equal spans under two names, a repeated span, a span of another request from before this one
  was received, and gaps: exact per-stage figures (computed by hand below) that add up to the
  timeline's E2E to the microsecond, whatever order the stages come in. Negative controls: the
  union times of the same timeline (``RequestRecord.stages``) overshoot the E2E by the overlaps,
  and a "latest start wins" attribution would book the encode as a features wait.
* ``report``: the exclusive means add up to the mean server-side E2E and are printed with their total.
* ``compare``: the stage rows and ``stage_breakdown.png`` use the exclusive times where a result has
  them (and are named so), union times for an older result; a result JSON written before the
  field existed still loads.
Pure logic on synthetic data: no service processes (the end-to-end run is in test_bench.py).
"""

from __future__ import annotations

import json
import random

import pytest
from PIL import Image

from shared.tools.bench import compare, report, runner
from shared.tools.bench.schema import UNTRACKED, BenchResult, RequestRecord, RunResult, WorkloadSpec, dump, load

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def stage(name: str, start_ms: float, end_ms: float | None = None) -> dict:
    """One stage as ``Timeline.to_json`` writes it (seconds, rounded to microseconds)."""
    start, end = round(start_ms / 1e3, 6), None if end_ms is None else round(end_ms / 1e3, 6)
    return {
        "name": name,
        "service": "x",
        "detail": "",
        "start_s": start,
        "end_s": end,
        "duration_s": None if end is None else round(max(0.0, end - start), 6),
    }


# An E|P|D image request with two images (ms after received):
#   image intake 0-20, encode queued 20-22, (nothing 22-25), generation queued 25-30,
#   encode 27-60 (starts before the prefill worker takes the job, ends inside its features wait),
#   EC loaded from store 30-70 (image 1, listed twice) and EC from local cache 30-70 (image 2: the
#   worker's one features span, told once per image), EC stored 60-61.001 (inside the wait),
#   prefill 70-100, (nothing 100-103), first token at 103, KV hand-off 103-110, decode queued
#   110-111, decode 111-150, done at 150; plus another request's encode at -5..-1 (a deduplicated
#   job's, before this request was received) and points that take no time.
SYNTHETIC = [
    stage("received", 0),
    stage("image intake", 0, 20),
    stage("encode queued", 20, 22),
    stage("encode", -5, -1),
    stage("no encode job", 22),
    stage("generation queued", 25, 30),
    stage("encode", 27, 60),
    stage("EC loaded from store", 30, 70),
    stage("EC loaded from store", 30, 70),
    stage("EC from local cache", 30, 70),
    stage("EC stored", 60, 61.001),
    stage("prefill", 70, 100),
    stage("first token", 103),
    stage("KV hand-off", 103, 110),
    stage("decode queued", 110, 111),
    stage("decode", 111, 150),
    stage("done", 150),
]
E2E_S = 0.150

# Each elementary interval to the covering span that ends first (ties: the later start; equal spans
# share it, the odd microsecond to the first name in sorted order):
EXCLUSIVE = {
    "image intake": 0.020,  # 0-20
    "encode queued": 0.002,  # 20-22
    UNTRACKED: 0.006,  # 22-25 and 100-103
    "generation queued": 0.005,  # 25-30 (27-30: it ends before the encode does)
    "encode": 0.030,  # 30-60 (ends before the features wait it overlaps)
    "EC stored": 0.001001,  # 60-61.001 (inside the wait)
    "EC from local cache": 0.0045,  # 61.001-70: 8999 us shared, 4500 ...
    "EC loaded from store": 0.004499,  # ... and 4499
    "prefill": 0.030,  # 70-100
    "KV hand-off": 0.007,  # 103-110
    "decode queued": 0.001,  # 110-111
    "decode": 0.039,  # 111-150
}
# Union of each stage's spans (what RequestRecord.stages holds): they overlap.
UNION = {
    "image intake": 0.020,
    "encode queued": 0.002,
    "generation queued": 0.005,
    "encode": 0.037,
    "EC loaded from store": 0.040,
    "EC from local cache": 0.040,
    "EC stored": 0.001001,
    "prefill": 0.030,
    "KV hand-off": 0.007,
    "decode queued": 0.001,
    "decode": 0.039,
}


def doc_of(stages: list[dict]) -> dict:
    return {"timeline": {"stages": stages}, "case": {"request_id": "r", "messages": []}}


def us(seconds: float) -> int:
    return round(seconds * 1e6)


def test_exclusive_times_partition_a_synthetic_timeline():
    got = runner.exclusive_stage_times(doc_of(SYNTHETIC))
    assert got == EXCLUSIVE  # exact: whole microseconds / 1e6 are the same floats as the literals
    assert sum(map(us, got.values())) == us(E2E_S)  # adds up to the E2E to the microsecond
    assert sum(got.values()) == pytest.approx(E2E_S, abs=1e-12)
    # The order the stages come in does not matter (ties are broken by name, not by position).
    for seed in range(5):
        shuffled = list(SYNTHETIC)
        random.Random(seed).shuffle(shuffled)
        assert runner.exclusive_stage_times(doc_of(shuffled)) == EXCLUSIVE


def test_union_times_of_the_same_timeline_do_not_add_up():
    """Negative control: the stacked union times overshoot the E2E by exactly the overlaps."""
    union, _ = runner.parse_timeline(doc_of(SYNTHETIC))
    assert union == pytest.approx(UNION, abs=1e-9)
    # Counted more than once: 27-30 twice (generation queued, encode), 30-60 three times (encode and
    # both EC stages), 60-61.001 three times (EC stored and both), 61.001-70 twice (both EC stages).
    # The union also has the other request's encode before t0 (4 ms) and lacks the untracked 6 ms.
    overcount = 0.003 + 0.030 * 2 + 0.001001 * 2 + 0.008999
    assert sum(union.values()) == pytest.approx(E2E_S + overcount + 0.004 - 0.006, abs=1e-9)
    assert sum(union.values()) != pytest.approx(E2E_S, abs=1e-3)


def test_partial_overlap_goes_to_the_span_that_ends_first_not_the_latest_start():
    """The features wait starts after the encode and outlasts it: the shared time is encoding.
    A "latest start wins" sweep would book it as the wait (negative control in the numbers)."""
    doc = doc_of(
        [stage("received", 0), stage("encode", 10, 50), stage("EC loaded from store", 20, 60), stage("done", 60)]
    )
    assert runner.exclusive_stage_times(doc) == {UNTRACKED: 0.010, "encode": 0.040, "EC loaded from store": 0.010}
    latest_start_encode = 0.010  # 10-20 only
    assert runner.exclusive_stage_times(doc)["encode"] != latest_start_encode
    # Nested: the inner span (later start, earlier end) wins either way; a tie on the end goes to
    # the later start.
    nested = doc_of([stage("EC loaded from store", 0, 40), stage("encode", 5, 30), stage("EC stored", 30, 40)])
    assert runner.exclusive_stage_times(nested) == {"EC loaded from store": 0.005, "encode": 0.025, "EC stored": 0.010}


def test_edge_cases():
    assert runner.exclusive_stage_times({}) == {}
    assert runner.exclusive_stage_times(doc_of([stage("received", 0)])) == {}
    # Points only: all untracked up to the last one.
    assert runner.exclusive_stage_times(doc_of([stage("received", 0), stage("error", 12)])) == {UNTRACKED: 0.012}
    # A span past the last point still counts (the last event is the latest start or end).
    assert runner.exclusive_stage_times(doc_of([stage("decode", 2, 9), stage("done", 8)])) == {
        UNTRACKED: 0.002,
        "decode": 0.007,
    }


# -- records, summaries, reports --------------------------------------------------------------------
def record(i: int, doc: dict, *, ok: bool = True, exclusive: bool = True) -> RequestRecord:
    union, _ = runner.parse_timeline(doc)
    return RequestRecord(
        index=i,
        kind="image",
        images=1,
        sent_at=0.0,
        ok=ok,
        status=200 if ok else 503,
        output_tokens=8,
        ttft_s=0.1 if ok else None,
        e2e_s=0.2 if ok else None,
        stages=union,
        exclusive_stages=runner.exclusive_stage_times(doc) if exclusive else {},
    )


# A text-only request: generation queued 1-3, prefill 3-13, (13-15 nothing), decode 15-50, done 50.
TEXT = doc_of(
    [
        stage("received", 0),
        stage("generation queued", 1, 3),
        stage("prefill", 3, 13),
        stage("first token", 15),
        stage("decode", 15, 50),
        stage("done", 50),
    ]
)
TEXT_E2E_S = 0.050


def records() -> tuple[RequestRecord, ...]:
    return (
        record(0, doc_of(SYNTHETIC)),
        record(1, TEXT),
        record(2, TEXT, exclusive=False),  # its timeline unread: left out of the exclusive means
        record(3, doc_of(SYNTHETIC), ok=False),
    )  # failed: left out


MEAN_E2E_S = (E2E_S + TEXT_E2E_S) / 2


def test_summary_exclusive_means_add_up_to_the_mean_e2e():
    s = report.summarize(records(), 10.0)
    means = s.exclusive_stage_means_s
    assert sum(means.values()) == pytest.approx(MEAN_E2E_S, abs=1e-12)
    assert means["decode"] == pytest.approx((0.039 + 0.035) / 2, abs=1e-12)
    assert means["encode"] == pytest.approx(0.030 / 2, abs=1e-12)  # the text request counts 0
    assert means[UNTRACKED] == pytest.approx((0.006 + 0.003) / 2, abs=1e-12)  # 0-1 and 13-15 in TEXT
    assert list(means)[-1] == UNTRACKED
    # The union means are as before: over the requests that have the stage, overlapping.
    assert s.stage_means_s["encode"] == pytest.approx(0.037)
    assert sum(s.stage_means_s.values()) > sum(means.values())
    text = report.format_result(
        BenchResult(
            label="x",
            url="http://x",
            model="m",
            epd=True,
            started_at=0.0,
            machine="t",
            spec=WorkloadSpec(),
            runs=(RunResult(rate=None, concurrency=1, requests=records(), summary=s),),
        )
    )
    assert "Exclusive stages (mean ms per request, 2)" in text, text
    assert f"\n{'total = server-side E2E:':<40}{MEAN_E2E_S * 1e3:.2f}\n" in text, text
    assert f"\n{'encode:':<40}15.00\n" in text, text


def result(label: str, recs: tuple[RequestRecord, ...]) -> BenchResult:
    s = report.summarize(recs, 5.0)
    return BenchResult(
        label=label,
        url="http://127.0.0.1:1",
        model="tiny",
        epd=True,
        started_at=0.0,
        machine="test",
        spec=WorkloadSpec(),
        runs=(RunResult(rate=1.0, concurrency=None, requests=recs, summary=s),),
    )


def old_file_bytes(res: BenchResult) -> bytes:
    """``res`` as a result file from before exclusive times: without either new field."""
    doc = json.loads(dump(res))
    for run in doc["runs"]:
        del run["summary"]["exclusive_stage_means_s"]
        for r in run["requests"]:
            del r["exclusive_stages"]
    text = json.dumps(doc)
    assert "exclusive" not in text
    return text.encode()


def test_an_old_result_without_exclusive_times_loads():
    new = result("new", records())
    old = load(old_file_bytes(new))
    assert old.runs[0].summary.exclusive_stage_means_s == {}
    assert all(r.exclusive_stages == {} for r in old.runs[0].requests)
    assert old.runs[0].requests[0].stages == new.runs[0].requests[0].stages
    assert not compare.has_exclusive(old.runs[0]) and compare.has_exclusive(new.runs[0])
    # ... and is drawn with its union times per completed request (3 of them), as before.
    done = [r for r in records() if r.ok]
    union = {name: sum(r.stages.get(name, 0.0) for r in done) / 3 for name in UNION}
    assert compare.stage_seconds_per_request(old.runs[0]) == pytest.approx(union, abs=1e-12)


def test_stage_bars_draw_the_exclusive_series_and_add_up_to_e2e(tmp_path):
    new = result("new", records())
    plot = compare.plot_stage_breakdown([new], ["new"], tmp_path / "stages.png")
    assert plot.path.read_bytes().startswith(PNG_SIGNATURE)
    with Image.open(plot.path) as img:
        img.verify()
    drawn = plot.axes[compare.EXCLUSIVE_TITLE]
    # Stacked in the order a request meets the stages, untracked last; per completed request with
    # a timeline: SYNTHETIC's and TEXT's figures over 2.
    assert list(drawn) == [
        "image intake",
        "encode queued",
        "encode",
        "EC stored",
        "generation queued",
        "EC from local cache",
        "EC loaded from store",
        "prefill",
        "KV hand-off",
        "decode queued",
        "decode",
        UNTRACKED,
    ]
    expected = report.exclusive_means(records())
    for name, (xs, ys) in drawn.items():  # (drawn in ms)
        assert xs == [0.0] and ys == [pytest.approx(expected[name] * 1e3, abs=1e-9)], name
    assert sum(ys[0] for _, ys in drawn.values()) == pytest.approx(MEAN_E2E_S * 1e3, abs=1e-9)
    # Negative control: the union bar of the two timed requests overshoots their mean E2E (100 ms)
    # by SYNTHETIC's overlaps: (222.001 + 47) / 2 ms.
    timed = result("timed", records()[:2])
    union_total = sum(compare.stage_seconds_per_request(load(old_file_bytes(timed)).runs[0]).values())
    assert union_total == pytest.approx((sum(UNION.values()) + 0.047) / 2, abs=1e-12)
    assert union_total > MEAN_E2E_S + 0.03


def test_stage_bars_next_to_an_old_result_mark_its_union_bar(tmp_path):
    new = result("new", records())
    old = load(old_file_bytes(result("old", records())))
    plot = compare.plot_stage_breakdown([old, new], ["old", "new"], tmp_path / "mixed.png")
    drawn = plot.axes[compare.EXCLUSIVE_TITLE]
    assert drawn["encode"] == ([0.0, 1.0], [pytest.approx(37 / 3), pytest.approx(30 / 2)])  # ms
    assert drawn[UNTRACKED] == ([0.0, 1.0], [0.0, pytest.approx(4.5)])
    # Only union bars: the old title, as before.
    only_old = compare.plot_stage_breakdown([old], ["old"], tmp_path / "old.png")
    assert list(only_old.axes) == [compare.UNION_TITLE]
    assert UNTRACKED not in only_old.axes[compare.UNION_TITLE]


def test_compare_rows_use_the_exclusive_times_and_name_them(tmp_path, capsys):
    new = result("new", records())
    old = load(old_file_bytes(result("old", records())))
    (point,) = compare.compare([new, old])
    rows = {r.metric: r for r in point.rows}
    staged = [m for m in rows if m.startswith("stage ")]
    assert staged[:3] == [
        "stage image intake (ms, exclusive)",
        "stage encode queued (ms, exclusive)",
        "stage encode (ms, exclusive)",
    ]
    assert staged[11:13] == [f"stage {UNTRACKED} (ms, exclusive)", "stage total (ms, exclusive)"]
    assert staged[13] == "stage image intake (ms)"  # the old result's union rows follow
    assert rows["stage encode (ms, exclusive)"].values == (pytest.approx(15.0), None)
    assert rows["stage total (ms, exclusive)"].values == (pytest.approx(MEAN_E2E_S * 1e3), None)
    assert rows["stage encode (ms)"].values == (None, pytest.approx(37.0))
    # Neither kind is divided by the other.
    assert rows["stage encode (ms, exclusive)"].ratios == (None,) and rows["stage encode (ms)"].ratios == (None,)
    # The CLI says what the exclusive rows are, and writes the bars.
    files = [tmp_path / "new.json", tmp_path / "old.json"]
    files[0].write_bytes(dump(new))
    files[1].write_bytes(old_file_bytes(result("old", records())))
    from shared.tools.cli import main

    assert main(["bench", "compare", *map(str, files), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "they add up to the stage total = mean server-side E2E" in out, out
    assert (tmp_path / "plots" / "stage_breakdown.png").read_bytes().startswith(PNG_SIGNATURE)
