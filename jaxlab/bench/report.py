"""From ``records.jsonl`` to ``summary.csv``, ``summary.md`` and ``plots/*.png``.

These files are derived: they can be regenerated at any time (``jaxlab bench report``);
``records.jsonl`` is the source of truth and is only ever appended to.

Plots use matplotlib's Agg renderer (no display, no pyplot state). matplotlib is an
optional dependency (``pip install 'jaxlab[plots]'``); without it the plots are skipped
and the summary says so. A suite gets a dedicated plot through :func:`plotter`; any other
suite gets the generic one (median with min-max bars per case). A record that carries a
series over time (``derived["timeline"]``, :mod:`jaxlab.bench.timeline`) also gets its
timeline plot, ``plots/<suite>-timeline.png``.
"""

from __future__ import annotations

import csv
import json
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxlab.bench.record import Record, case_label, load_records

SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
PLOTS_DIR = "plots"
MATPLOTLIB_MISSING = "plots skipped: matplotlib is not installed (pip install 'jaxlab[plots]')"

CSV_COLUMNS = (
    "suite",
    "case",
    "metric",
    "unit",
    "status",
    "n",
    "median",
    "mean",
    "std",
    "min",
    "max",
    "p90",
    "p99",
    "tails_withheld",
    "derived",
    "error",
)


@dataclass
class ReportResult:
    run_dir: Path
    files: list[Path] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- formatting


def fmt_value(value: float | None, unit: str) -> str:
    """Human form of a value in ``unit`` (seconds scaled to ms/us/ns)."""
    if value is None:
        return "-"
    if unit == "s":
        for scale, suffix in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= scale:
                return f"{value / scale:.4g} {suffix}"
        return f"{value / 1e-9:.4g} ns"
    return f"{value:.4g} {unit}".strip()


def fmt_derived(derived: dict[str, Any]) -> str:
    parts = []
    for k, v in derived.items():
        if v is None or k.startswith("corpus_"):
            continue
        if isinstance(v, float):
            parts.append(f"{k}={v:.4g}")
        elif isinstance(v, bool | int | str):
            parts.append(f"{k}={v}")
    return " ".join(parts)


# Derived figures worth a column in a terminal table, in this order.
HEADLINE_KEYS = (
    "gflops",
    "gb_per_s",
    "mb_per_s",
    "tokens_per_s",
    "mfu",
    "mfu_basis",
    "bw_util",
    "first_over_steady",
    "variant",
)


def fmt_headline(derived: dict[str, Any]) -> str:
    """The few derived figures a reader scans for (all of them go to summary.md)."""
    keys = [k for k in HEADLINE_KEYS if derived.get(k) is not None]
    if not keys:
        keys = [k for k, v in derived.items() if isinstance(v, float)][:2]
    return fmt_derived({k: derived[k] for k in keys})


def tail_text(record: Record, which: str) -> str:
    s = record.stats
    if not record.ok:
        return "-"
    if s.tails_withheld:
        return f"withheld (n<{_threshold(s.tails_reason)})"
    return fmt_value(getattr(s, which), record.unit)


def _threshold(reason: str | None) -> str:
    if reason and "min_samples_for_tails=" in reason:
        return reason.rsplit("=", 1)[1]
    return "?"


def summary_row(r: Record) -> dict[str, Any]:
    s = r.stats
    return {
        "suite": r.suite,
        "case": r.case,
        "metric": r.metric,
        "unit": r.unit,
        "status": r.status,
        "n": len(r.samples),
        "median": s.median,
        "p90": s.p90,
        "p99": s.p99,
        "tails_withheld": s.tails_withheld,
        "derived": r.derived,
        "error": r.error,
    }


def summary_rows(records: Iterable[Record]) -> list[dict[str, Any]]:
    return [summary_row(r) for r in records]


def by_suite(records: Iterable[Record]) -> dict[str, list[Record]]:
    out: dict[str, list[Record]] = {}
    for r in records:
        out.setdefault(r.suite, []).append(r)
    return out


# --------------------------------------------------------------------------- csv / md


def write_csv(path: Path, records: Sequence[Record]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in records:
            s = r.stats
            w.writerow(
                [
                    r.suite,
                    case_label(r.case),
                    r.metric,
                    r.unit,
                    r.status,
                    len(r.samples),
                    *("" if v is None else repr(v) for v in (s.median, s.mean, s.std)),
                    *("" if v is None else repr(v) for v in (s.min, s.max, s.p90, s.p99)),
                    s.tails_withheld,
                    json.dumps(r.derived, sort_keys=True),
                    r.error or "",
                ]
            )


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(records: Sequence[Record], notes: Sequence[str] = ()) -> str:
    lines = []
    first = records[0] if records else None
    lines.append(f"# Benchmark run {first.run_id if first else '(empty)'}")
    lines.append("")
    if first is not None:
        d, c, g = first.devices, first.cpu, first.git
        commit = (g.commit or "unknown")[:12] + (" (dirty)" if g.dirty else "")
        lines.append(
            f"{d.count}x {d.platform} {d.kind} · CPU {c.model} ({c.cores} cores"
            f"{', ' + c.simd if c.simd else ''}) · "
            f"jax {first.versions.get('jax', '?')} · commit {commit} · "
            f"config {first.config_hash or '-'}"
        )
        lines.append("")
        failed = sum(not r.ok for r in records)
        lines.append(f"{len(records)} records, {failed} failed.")
        lines.append("")
    for suite_name, recs in by_suite(records).items():
        lines.append(f"## {suite_name}")
        lines.append("")
        lines.append("| case | metric | median | p90 | p99 | unit | n | derived | status |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in recs:
            status = r.status if r.ok else f"FAILED: {r.error}"
            cells = [
                case_label(r.case),
                r.metric,
                fmt_value(r.stats.median, r.unit) if r.ok else "-",
                tail_text(r, "p90"),
                tail_text(r, "p99"),
                r.unit,
                str(len(r.samples)),
                fmt_derived(r.derived),
                status,
            ]
            lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
        lines.append("")
    if notes:
        lines.append("## Notes")
        lines.append("")
        lines.extend(f"- {n}" for n in notes)
        lines.append("")
    lines.append(
        "Medians of raw samples (see docs/benchmarking.md). Tails are withheld below "
        "`bench.min_samples_for_tails` samples. Compare runs only from the same machine."
    )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots

Plotter = Callable[[list[Record], Any], None]  # (records of one suite, matplotlib Figure)
PLOTTERS: dict[str, Plotter] = {}


def plotter(suite_name: str) -> Callable[[Plotter], Plotter]:
    """Register a dedicated plot for a suite: ``fn(records, figure)`` draws on the figure."""

    def register(fn: Plotter) -> Plotter:
        PLOTTERS[suite_name] = fn
        return fn

    return register


def _bars(ax: Any, labels: list[str], values: list[float], ylabel: str, title: str) -> None:
    xs = list(range(len(values)))
    bars = ax.bar(xs, values, color="#4C72B0")
    ax.set_xticks(xs, labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    for bar, v in zip(bars, values, strict=True):
        ax.annotate(
            f"{v:.4g}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )


def _derived_bars(recs: list[Record], key: str) -> tuple[list[str], list[float]]:
    labels, values = [], []
    for r in recs:
        v = r.derived.get(key)
        if r.ok and isinstance(v, int | float):
            labels.append(case_label(r.case))
            values.append(float(v))
    return labels, values


@plotter("peak")
def _plot_peak(recs: list[Record], fig: Any) -> None:
    mm = [r for r in recs if r.metric == "matmul_time"]
    cp = [r for r in recs if r.metric == "copy_time"]
    axes = fig.subplots(1, 2)
    labels, values = _derived_bars(mm, "gflops")
    _bars(axes[0], labels, values, "GFLOP/s", "matmul throughput (2n^3 / median)")
    labels, values = _derived_bars(cp, "gb_per_s")
    _bars(axes[1], labels, values, "GB/s", "memory bandwidth (copy: read + write; read)")


@plotter("tokenizer")
def _plot_tokenizer(recs: list[Record], fig: Any) -> None:
    ax = fig.subplots()
    labels, values = _derived_bars(recs, "mb_per_s")
    _bars(ax, labels, values, "MB/s", "tokenizer throughput (corpus bytes / median)")


@plotter("compile")
def _plot_compile(recs: list[Record], fig: Any) -> None:
    ax = fig.subplots()
    ok = [r for r in recs if r.ok and r.stats.median is not None]
    labels = [r.metric.removesuffix("_time") for r in ok]
    med = [r.stats.median or 0.0 for r in ok]
    lo = [m - (r.stats.min or m) for m, r in zip(med, ok, strict=True)]
    hi = [(r.stats.max or m) - m for m, r in zip(med, ok, strict=True)]
    xs = list(range(len(ok)))
    colors = [
        "#C44E52" if ("first" in lab or lab in ("trace", "lower", "compile")) else "#4C72B0"
        for lab in labels
    ]
    ax.bar(xs, med, yerr=[lo, hi], color=colors, capsize=3)
    ax.set_xticks(xs, labels, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (median, min-max bars, log scale)")
    ax.set_title("compile stages and first call (red) vs steady state (blue)", fontsize=10)


def _plot_generic(recs: list[Record], fig: Any) -> None:
    ok = [r for r in recs if r.ok and r.stats.median is not None]
    ax = fig.subplots()
    labels = [f"{r.metric} {case_label(r.case)}"[:60] for r in ok]
    med = [r.stats.median or 0.0 for r in ok]
    lo = [m - (r.stats.min or m) for m, r in zip(med, ok, strict=True)]
    hi = [(r.stats.max or m) - m for m, r in zip(med, ok, strict=True)]
    ys = list(range(len(ok)))
    ax.barh(ys, med, xerr=[lo, hi], color="#4C72B0", capsize=3)
    ax.set_yticks(ys, labels, fontsize=7)
    units = sorted({r.unit for r in ok})
    ax.set_xlabel(f"median, min-max bars ({', '.join(units)})")
    if units == ["s"] and med and max(med) / max(min(med), 1e-12) > 100:
        ax.set_xscale("log")


def write_plots(run_dir: Path, records: Sequence[Record]) -> tuple[list[Path], list[str]]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return [], [MATPLOTLIB_MISSING]
    out_dir = run_dir / PLOTS_DIR
    plots: list[Path] = []
    notes: list[str] = []
    for suite_name, recs in by_suite(records).items():
        if not any(r.ok for r in recs):
            notes.append(f"no plot for {suite_name}: every record failed")
            continue
        n_rows = sum(r.ok for r in recs)
        fig = Figure(figsize=(9, max(3.5, 0.35 * n_rows + 1.5)), layout="constrained")
        try:
            PLOTTERS.get(suite_name, _plot_generic)(recs, fig)
            fig.suptitle(f"{suite_name} · run {recs[0].run_id}", fontsize=9)
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{suite_name}.png"
            fig.savefig(path, dpi=110)
            plots.append(path)
        except Exception as e:  # a plot must never fail the run
            notes.append(f"plot for {suite_name} failed: {type(e).__name__}: {e}")
    drawn, timeline_notes = _timeline_plots(run_dir, records)
    return plots + drawn, notes + timeline_notes


def _timeline_plots(run_dir: Path, records: Sequence[Record]) -> tuple[list[Path], list[str]]:
    """The timeline of the first record of each suite that carries one."""
    from jaxlab.bench.timeline import timeline_plot_path, write_timeline_plot

    plots: list[Path] = []
    notes: list[str] = []
    done: set[str] = set()
    for r in records:
        series = r.derived.get("timeline") if r.ok else None
        if not isinstance(series, dict) or r.suite in done:
            continue
        done.add(r.suite)
        path = run_dir / timeline_plot_path(r.suite)
        title = f"{r.suite} · run {r.run_id}\n" + textwrap.fill(case_label(r.case), 110)
        note = write_timeline_plot(series, path, title)
        if note is None:
            plots.append(path)
        else:
            notes.append(note)
    return plots, notes


def write_report(
    run_dir: str | Path, records: Sequence[Record] | None = None, *, plots: bool = True
) -> ReportResult:
    """Write summary.csv, summary.md and plots/*.png for a run directory."""
    run_dir = Path(run_dir)
    recs = list(load_records(run_dir) if records is None else records)
    result = ReportResult(run_dir=run_dir)
    if plots:
        result.plots, result.notes = write_plots(run_dir, recs)
    csv_path, md_path = run_dir / SUMMARY_CSV, run_dir / SUMMARY_MD
    write_csv(csv_path, recs)
    md_path.write_text(render_markdown(recs, result.notes), encoding="utf-8")
    result.files = [csv_path, md_path, *result.plots]
    return result
