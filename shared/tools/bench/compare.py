"""``epd bench compare A.json B.json ... [--plots DIR]``: bench results side by side, and plots.

Each file is a :class:`~shared.tools.bench.schema.BenchResult`. Runs are matched by their load point
(same ``rate`` and ``concurrency``); a result none of whose points the first result has is matched
by order instead (its i-th run next to the first result's i-th run). For every matched point the
table gives each result's value and its ratio to the first result's (``B/A``, ``C/A``, ...; in two
blocks whose headers say which way the ratio is better: ``B/A (higher is better)``, then ``(lower is better)``):
throughputs, TTFT/TPOT/ITL/E2E mean/median/p90/p99, goodput, and the stage means where the result
is from epd-serve. It reads the summaries, not the raw records, except for two plots: the latency
CDFs (every completed request's ``ttft_s`` / ``e2e_s``) and the stage bars (per-request stages).

The columns are keyed A, B, C, ... (a legend above the tables names each result). Stage rows are,
for a result that recorded them, the *exclusive* stage times (``stage <name> (ms, exclusive)``:
mean per request, each instant of a request's timeline in one stage, ``untracked`` where none ran,
see ``runner.exclusive_stage_times``) and their ``stage total`` (the mean server-side E2E, received
to last event); for an older result, the union stage means (``stage <name> (ms)``, over the
requests that have the stage; these overlap, so they do not add up). The two kinds have different
row names, so no ratio compares one with the other.

Plots (``--plots DIR``, PNG, matplotlib's Agg canvas, no display needed): ``latency_cdf.png`` (TTFT
and E2E, one line per result and run; log x axis when the range spans more than 50x),
``ttft_vs_rate.png`` (median and p90 TTFT per run against the offered rate, or the measured request
rate for concurrency runs; drawn when there are at least two load points), ``stage_breakdown.png``
(stacked stage ms per completed request, one bar per epd-serve run: exclusive times, so a bar
adds up to the mean server-side E2E; a run from before exclusive times draws its union times,
marked "union, overlaps" in its bar label). Each
plotting function returns a :class:`Plot` read back from the drawn figure (the series labels and
their data), so callers and tests see what was drawn.

Exit codes: 0 ok; 2 a file is missing or not a bench result (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shared.protocol import StageName
from shared.tools.bench.report import exclusive_means
from shared.tools.bench.schema import UNTRACKED, BenchResult, RunResult, Summary, load

EXIT_ERROR = 2

#: Stages in the order a request meets them (the bars stack in this order; others follow by name).
STAGE_ORDER = (
    StageName.IMAGE_INTAKE,
    StageName.ENCODE_QUEUED,
    StageName.ENCODE,
    StageName.EC_STORED,
    StageName.GENERATION_QUEUED,
    StageName.EC_FROM_LOCAL_CACHE,
    StageName.EC_LOADED_FROM_STORE,
    StageName.EC_RECOMPUTED,
    StageName.EC_ENCODED_IN_PROCESS,
    StageName.PREFILL,
    StageName.KV_HANDOFF,
    StageName.DECODE_QUEUED,
    StageName.DECODE,
    UNTRACKED,
)
#: Suffixes of the stage rows: exclusive times (they add up to the total row), union times (older results).
EXCLUSIVE_ROW, UNION_ROW = " (ms, exclusive)", " (ms)"
STAGE_TOTAL = "total"

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
QUANTILES = ("mean", "median", "p90", "p99")


class CompareError(Exception):
    """A file could not be read as a bench result."""


@dataclass(frozen=True)
class Row:
    """One metric across the results: ``values[i]`` of result i (None: not measured) and
    ``ratios[i-1]`` = values[i] / values[0] (None when either is missing or the base is 0)."""

    metric: str
    values: tuple[float | None, ...]
    ratios: tuple[float | None, ...]


@dataclass(frozen=True)
class Point:
    """One matched load point: the run of each result there (None: that result has none)."""

    title: str
    runs: tuple[RunResult | None, ...]
    rows: tuple[Row, ...] = ()


@dataclass
class Plot:
    """What a plotting function drew: the file, and per axes title its series (label -> (x, y))."""

    path: Path
    axes: dict[str, dict[str, tuple[list[float], list[float]]]] = field(default_factory=dict)
    #: axes title -> its x-axis label (where the function records it)
    xlabels: dict[str, str] = field(default_factory=dict)

    def labels(self, axes_title: str) -> list[str]:
        return list(self.axes[axes_title])


# -- loading and matching --------------------------------------------------------------------------
def load_file(path: Path) -> BenchResult:
    try:
        return load(Path(path).read_bytes())
    except OSError as exc:
        raise CompareError(f"{path}: {exc.strerror or exc}") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CompareError(f"{path}: not a bench result: {exc}") from exc


def labels_of(results: list[BenchResult], paths: list[Path] | None = None) -> list[str]:
    """Each result's label; a label that repeats gets its file name (or position) appended."""
    base = [r.label or (paths[i].stem if paths else f"#{i + 1}") for i, r in enumerate(results)]
    out = []
    for i, label in enumerate(base):
        if base.count(label) > 1:
            label = f"{label} ({paths[i].name if paths else f'#{i + 1}'})"
        out.append(label)
    return out


def point_key(run: RunResult) -> tuple[float | None, int | None]:
    return (run.rate, None if run.rate is not None else run.concurrency)


def point_title(run: RunResult) -> str:
    if run.rate is not None:
        return f"rate {run.rate:g} req/s"
    return f"concurrency {run.concurrency}"


def match_runs(results: list[BenchResult]) -> list[Point]:
    """Points in the first result's run order (then points only others have), each with every
    result's run at that point; results sharing no point with the first are matched by order."""
    base = results[0]
    titles = [point_title(r) for r in base.runs]
    keys: list[Any] = [point_key(r) for r in base.runs]
    cells: list[list[RunResult | None]] = [[r] + [None] * (len(results) - 1) for r in base.runs]
    base_keys = set(keys)
    for j, res in enumerate(results[1:], start=1):
        by_order = not any(point_key(r) in base_keys for r in res.runs)
        for i, run in enumerate(res.runs):
            if by_order:
                slot = i
                if slot >= len(cells):
                    keys.append(("order", slot))
                    titles.append(f"run {slot + 1} (by order)")
                    cells.append([None] * len(results))
                elif point_key(run) != keys[slot]:
                    titles[slot] += f" ~ {point_title(run)} (by order)"
            else:
                key = point_key(run)
                if key in keys:
                    slot = keys.index(key)
                else:
                    keys.append(key)
                    titles.append(point_title(run))
                    cells.append([None] * len(results))
                    slot = len(cells) - 1
            if cells[slot][j] is None:
                cells[slot][j] = run
    return [Point(t, tuple(c)) for t, c in zip(titles, cells)]


# -- the table -------------------------------------------------------------------------------------
def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


#: metrics where more is better (their name starts so); every other one (failures, latencies,
#: stage times) is better lower
HIGHER_IS_BETTER = ("completed", "request throughput", "output token throughput", "goodput")


def better(metric: str) -> str:
    """``"higher"`` or ``"lower"``: which way a metric of :func:`compare`'s rows is better."""
    return "higher" if metric.startswith(HIGHER_IS_BETTER) else "lower"


def _metrics(summary: Summary | None, *, stages: bool) -> dict[str, float | None]:
    if summary is None:
        return {}
    out: dict[str, float | None] = {
        "completed": float(summary.completed),
        "failed": float(summary.failed),
        "request throughput (req/s)": summary.request_throughput,
        "output token throughput (tok/s)": summary.output_token_throughput,
    }
    for attr, name in LATENCIES:
        stats = getattr(summary, attr)
        for q in QUANTILES:
            out[f"{name} {q} (ms)"] = None if stats is None else getattr(stats, q)
    if summary.goodput is not None:
        out["goodput (req/s)"] = summary.goodput
    if stages and summary.exclusive_stage_means_s:
        for stage, seconds in summary.exclusive_stage_means_s.items():
            out[f"stage {stage}{EXCLUSIVE_ROW}"] = seconds * 1e3
        out[f"stage {STAGE_TOTAL}{EXCLUSIVE_ROW}"] = sum(summary.exclusive_stage_means_s.values()) * 1e3
    elif stages:
        for stage, seconds in summary.stage_means_s.items():
            out[f"stage {stage}{UNION_ROW}"] = seconds * 1e3
    return out


def _stage_rank(name: str) -> tuple[int, str]:
    return (STAGE_ORDER.index(name) if name in STAGE_ORDER else len(STAGE_ORDER), name)


def _stage_sort_key(metric: str) -> tuple[int, int, str]:
    """Exclusive rows (by stage order, their total last), then union rows (by stage order)."""
    if metric.endswith(EXCLUSIVE_ROW):
        name = metric[len("stage ") : -len(EXCLUSIVE_ROW)]
        return (0, *(_stage_rank(name) if name != STAGE_TOTAL else (len(STAGE_ORDER) + 1, "")))
    return (1, *_stage_rank(metric[len("stage ") : -len(UNION_ROW)]))


def compare(results: list[BenchResult]) -> list[Point]:
    """The matched points with their metric rows (see :class:`Row`)."""
    points = []
    for point in match_runs(results):
        per = [_metrics(run.summary if run else None, stages=res.epd) for run, res in zip(point.runs, results)]
        names: list[str] = []
        for m in per:
            names += [n for n in m if n not in names]
        plain = [n for n in names if not n.startswith("stage ")]
        staged = sorted((n for n in names if n.startswith("stage ")), key=_stage_sort_key)
        rows = []
        for name in plain + staged:
            values = tuple(m.get(name) for m in per)
            rows.append(Row(name, values, tuple(ratio(v, values[0]) for v in values[1:])))
        points.append(Point(point.title, point.runs, tuple(rows)))
    return points


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if v == int(v) and abs(v) < 1e9:
        return f"{int(v)}"
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"


def _ratio_text(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}x"


def column_keys(n: int) -> list[str]:
    """Short column names: A, B, ... Z, then R27, R28, ..."""
    return [chr(ord("A") + i) if i < 26 else f"R{i + 1}" for i in range(n)]


def format_compare(results: list[BenchResult], labels: list[str]) -> str:
    """The side-by-side text: a legend (A = the first result's label, ...), then per point a table
    metric | A | B | B/A | C | C/A ... in two blocks, each with its header saying which way its
    ratios are better: the metrics where higher is better, then those where lower is."""
    keys = column_keys(len(results))

    def header(direction: str) -> list[str]:
        cells = ["metric", keys[0]]
        for key in keys[1:]:
            cells += [key, f"{key}/{keys[0]} ({direction} is better)"]
        return cells

    lines = []
    for key, label, res in zip(keys, labels, results):
        lines.append(
            f"{key} = {label}: {res.url}  model {res.model}  {'epd-serve' if res.epd else 'other server'}"
            f"  ({len(res.runs)} run(s); {res.machine})"
        )
    if any(res.epd and run.summary.exclusive_stage_means_s for res in results for run in res.runs):
        lines.append(
            "stage rows (ms, exclusive): mean per request, each instant of its timeline in one stage "
            "(untracked: none); they add up to the stage total = mean server-side E2E"
        )
    for point in compare(results):
        blocks: list[list[list[str]]] = []
        for direction in ("higher", "lower"):
            block = [header(direction)]
            for row in point.rows:
                if better(row.metric) != direction:
                    continue
                cells = [row.metric, _num(row.values[0])]
                for v, r in zip(row.values[1:], row.ratios):
                    cells += [_num(v), _ratio_text(r)]
                block.append(cells)
            if len(block) > 1:
                blocks.append(block)
        ncols = len(blocks[0][0]) if blocks else 0
        widths = [max(len(r[c]) for b in blocks for r in b) for c in range(ncols)]
        lines.append("")
        lines.append(f"== {point.title} ==")
        for n_block, block in enumerate(blocks):
            if n_block:
                lines.append("")
            for k, cells in enumerate(block):
                lines.append(
                    "  ".join(c.ljust(widths[n]) if n == 0 else c.rjust(widths[n]) for n, c in enumerate(cells))
                )
                if k == 0:
                    lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------------
def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (8.0, 5.0)):
    """A figure on matplotlib's Agg canvas (no pyplot, no display, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(nrows * ncols)]
    return fig, axes


def _read_lines(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {
        ln.get_label(): ([float(x) for x in ln.get_xdata()], [float(y) for y in ln.get_ydata()])
        for ln in ax.get_lines()
        if not ln.get_label().startswith("_")
    }


def _run_label(label: str, run: RunResult, res: BenchResult) -> str:
    return label if len(res.runs) == 1 else f"{label} @ {point_title(run)}"


def plot_latency_cdfs(results: list[BenchResult], labels: list[str], path: Path) -> Plot:
    """TTFT and E2E CDFs (milliseconds), one line per result and run, of the completed requests."""
    fig, (ax_ttft, ax_e2e) = _figure(1, 2, (12.0, 5.0))
    for ax, attr, name in ((ax_ttft, "ttft_s", "TTFT"), (ax_e2e, "e2e_s", "E2E")):
        for res, label in zip(results, labels):
            for run in res.runs:
                ms = sorted(getattr(r, attr) * 1e3 for r in run.requests if r.ok and getattr(r, attr) is not None)
                if not ms:
                    continue
                # From 0 at the fastest request, so a one-request run still draws its step.
                ax.step(
                    [ms[0], *ms],
                    [0.0] + [(i + 1) / len(ms) for i in range(len(ms))],
                    where="post",
                    label=_run_label(label, run, res),
                )
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.02)
        xs = [x for line in ax.get_lines() for x in line.get_xdata()]
        if xs and min(xs) > 0 and max(xs) / min(xs) > 50:  # a long tail would squash the rest
            ax.set_xscale("log")
    _save(fig, path, ax_ttft, ax_e2e)
    return Plot(Path(path), {ax.get_title(): _read_lines(ax) for ax in (ax_ttft, ax_e2e)})


def _save(fig: Any, path: Path, *axes: Any) -> None:
    """Grid and legend on each line plot, then write the PNG."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png")


def load_points(results: list[BenchResult]) -> int:
    """Distinct x positions a TTFT-vs-rate plot would have."""
    return len({_rate_x(run) for res in results for run in res.runs if run.summary.ttft_ms is not None})


def _rate_x(run: RunResult) -> float:
    return run.rate if run.rate is not None else run.summary.request_throughput


def plot_ttft_vs_rate(results: list[BenchResult], labels: list[str], path: Path) -> Plot:
    """Median and p90 TTFT per run against the offered rate (measured request rate for concurrency
    runs): one ``<label> median`` and one ``<label> p90`` series per result, points sorted by rate."""
    fig, (ax,) = _figure()
    for res, label in zip(results, labels):
        pts = sorted(
            ((_rate_x(run), run.summary.ttft_ms) for run in res.runs if run.summary.ttft_ms is not None),
            key=lambda pt: pt[0],
        )
        if not pts:
            continue
        xs = [x for x, _ in pts]
        line = ax.plot(xs, [s.median for _, s in pts], marker="o", label=f"{label} median")[0]
        ax.plot(xs, [s.p90 for _, s in pts], marker="^", linestyle="--", color=line.get_color(), label=f"{label} p90")
    ax.set_title("TTFT vs rate")
    ax.set_xlabel("rate (req/s; offered, or measured for concurrency runs)")
    ax.set_ylabel("TTFT (ms)")
    _save(fig, path, ax)
    return Plot(Path(path), {ax.get_title(): _read_lines(ax)})


def has_exclusive(run: RunResult) -> bool:
    """True when the run recorded exclusive stage times (results from before them have none)."""
    return bool(run.summary.exclusive_stage_means_s) or any(r.ok and r.exclusive_stages for r in run.requests)


def stage_seconds_per_request(run: RunResult) -> dict[str, float]:
    """Each stage's seconds per completed request (a request without the stage adds 0).

    With exclusive times (:func:`has_exclusive`): ``report.exclusive_means`` of the records (else the
    summary's), which add up to the mean server-side E2E. Without (older results): the union
    times per completed request, from the summary's stage means (over the requests that have the
    stage) when the records carry no stages; these overlap, so their sum exceeds the E2E."""
    done = [r for r in run.requests if r.ok]
    if has_exclusive(run):
        return exclusive_means(done) or dict(run.summary.exclusive_stage_means_s)
    if not any(r.stages for r in done):
        return dict(run.summary.stage_means_s)
    totals: dict[str, float] = {}
    for r in done:
        for name, seconds in r.stages.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: total / len(done) for name, total in totals.items()}


#: The stage bars' titles: exclusive times (every bar, or some next to older results), union times only.
EXCLUSIVE_TITLE = "exclusive stage ms per request (epd-serve)"
UNION_TITLE = "stage ms per request (epd-serve)"
UNION_MARK = " (union, overlaps)"


def plot_stage_breakdown(results: list[BenchResult], labels: list[str], path: Path) -> Plot:
    """Stacked horizontal bars of the stage times per request (:func:`stage_seconds_per_request`,
    drawn in ms like the tables and the other plots), one bar per run of an epd-serve result. With
    exclusive times a bar is a partition of the mean request's server-side E2E (received to last
    event; ``untracked`` where no stage ran), titled :data:`EXCLUSIVE_TITLE`; a run without them (an
    older result) stacks its union times, which overlap and overshoot the E2E: its bar label gets
    :data:`UNION_MARK` when exclusive bars are drawn too, and the title is :data:`UNION_TITLE` when
    none is. The returned series are per stage: x = the bar index, y = that stage's ms."""
    from matplotlib import colormaps

    bars: list[tuple[str, dict[str, float], bool]] = [
        (_run_label(label, run, res), stage_seconds_per_request(run), has_exclusive(run))
        for res, label in zip(results, labels)
        if res.epd
        for run in res.runs
    ]
    bars = [(name, means, excl) for name, means, excl in bars if means]
    exclusive = any(excl for _, _, excl in bars)
    if exclusive:
        bars = [(name if excl else name + UNION_MARK, means, excl) for name, means, excl in bars]
    stages: list[str] = []
    for _, means, _ in bars:
        stages += [s for s in means if s not in stages]
    stages.sort(key=_stage_rank)
    fig, (ax,) = _figure(size=(12.0, 2.0 + 0.6 * max(3, len(bars))))
    left = [0.0] * len(bars)
    ys = list(range(len(bars)))
    palette = colormaps["tab20"]
    for i, stage in enumerate(stages):
        widths = [means.get(stage, 0.0) * 1e3 for _, means, _ in bars]
        color = "#bbbbbb" if stage == UNTRACKED else palette(i % palette.N)
        ax.barh(ys, widths, left=left, label=stage, color=color)
        left = [a + b for a, b in zip(left, widths)]
    ax.margins(x=0.05)
    ax.set_yticks(ys)
    ax.set_yticklabels([name for name, _, _ in bars])
    ax.invert_yaxis()
    if exclusive:
        ax.set_title(EXCLUSIVE_TITLE)
        ax.set_xlabel(
            "ms per request (mean); stages exclusive: a bar adds up to the mean server-side E2E "
            "(received -> last event)"
        )
    else:
        ax.set_title(UNION_TITLE)
        ax.set_xlabel("ms per request (mean over completed requests; stages overlap, so a bar can exceed the E2E)")
    if stages:
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight")
    # Read back what was drawn: one bar container per stage, in stacking order.
    drawn = {c.get_label(): ([float(y) for y in ys], [float(p.get_width()) for p in c.patches]) for c in ax.containers}
    return Plot(Path(path), {ax.get_title(): drawn}, {ax.get_title(): ax.get_xlabel()})


def write_plots(results: list[BenchResult], labels: list[str], out_dir: Path) -> list[Plot]:
    """The plots that apply to these results (see the module docstring), into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [plot_latency_cdfs(results, labels, out_dir / "latency_cdf.png")]
    if load_points(results) >= 2:
        plots.append(plot_ttft_vs_rate(results, labels, out_dir / "ttft_vs_rate.png"))
    if any(
        res.epd and any(run.summary.stage_means_s or run.summary.exclusive_stage_means_s for run in res.runs)
        for res in results
    ):
        plots.append(plot_stage_breakdown(results, labels, out_dir / "stage_breakdown.png"))
    return plots


# -- CLI -------------------------------------------------------------------------------------------
def add_parser(bench_sub: Any) -> None:
    """Add ``compare`` to the ``epd bench`` subcommands."""
    p = bench_sub.add_parser("compare", help="bench results side by side (ratios to the first), PNG plots")
    p.add_argument(
        "results",
        nargs="+",
        type=Path,
        metavar="RESULT.json",
        help="bench result files (epd bench run --out); ratios are relative to the first",
    )
    p.add_argument("--plots", type=Path, metavar="DIR", help="write latency CDFs, TTFT vs rate and stage bars here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        results = [load_file(p) for p in args.results]
    except CompareError as exc:
        print(f"epd bench compare: {exc}", file=sys.stderr)
        return EXIT_ERROR
    labels = labels_of(results, list(args.results))
    print(format_compare(results, labels))
    if args.plots:
        plots = write_plots(results, labels, args.plots)
        print()
        for plot in plots:
            print(f"wrote {plot.path}")
    return 0
