"""``jaxlab bench``: run benchmark suites, summarise and compare runs.

``jaxlab bench [SUITE...]`` is short for ``jaxlab bench run [SUITE...]``: a first argument
that is not a subcommand (``run``, ``peak``, ``compare``, ``report``, ``list``) is routed to
``run``. jax is imported only inside command bodies.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from jaxlab.cli.common import (
    EXIT_FAILURE,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    UsageProblem,
    console,
    emit_json,
    resolve,
)

if TYPE_CHECKING:
    from jaxlab.bench.compare import Comparison
    from jaxlab.bench.record import Record
    from jaxlab.bench.suites import BenchRun

DEFAULT_COMMAND = "run"


class _BenchGroup(TyperGroup):
    """Routes ``jaxlab bench SUITE... [options]`` to ``jaxlab bench run SUITE...``."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing and (
            not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names)
        ):
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_BenchGroup,
    name="bench",
    help=(
        "Benchmark suites with honest timing (docs/benchmarking.md). "
        "`jaxlab bench [SUITE...] [--quick]` is `jaxlab bench run [SUITE...]`; "
        "no suite runs every default suite (all but serve)."
    ),
    epilog="Examples: jaxlab bench --quick · jaxlab bench peak · jaxlab bench compare RUN_A RUN_B",
    rich_markup_mode=None,
)


def _complete_suites(incomplete: str) -> list[str]:
    from jaxlab.bench.suites import known_suites

    return [s for s in known_suites() if s.startswith(incomplete)]


SuitesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Suites to run (see `jaxlab bench list`); none = all default suites.",
        autocompletion=_complete_suites,
        show_default=False,
    ),
]
QuickOpt = Annotated[
    bool, typer.Option("--quick", help="Small sizes and at most 5 samples per case.")
]
OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="Output root (default bench.out_dir or <runtime.artifacts_dir>/benchmarks)."
    ),
]
CpuOpt = Annotated[bool, typer.Option("--cpu", help="Force the CPU platform.")]
UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Load this running server in the serve suite instead of starting servers "
        "(bench.serve_url): http://HOST:PORT, or unix:PATH for one on a unix socket "
        "(jaxlab serve --uds PATH).",
    ),
]
ProfileOpt = Annotated[
    bool,
    typer.Option(
        "--profile",
        help="Also trace one untimed call of each measured case with jax.profiler, into "
        "<run dir>/profile/ (TensorBoard or ui.perfetto.dev; docs/benchmarking.md).",
    ),
]


# --------------------------------------------------------------------------- live view


class _LiveReporter:
    """Spinner with the current case on a terminal, plain lines otherwise; all on stderr."""

    def __init__(self) -> None:
        self._status = console.status("starting", spinner="dots") if console.is_terminal else None

    def __enter__(self) -> _LiveReporter:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()

    def suite_started(self, suite: str) -> None:
        console.print(Text(f"suite {suite}", style="bold"))

    def case_started(self, suite: str, text: str) -> None:
        if self._status is not None:
            self._status.update(Text(f"{suite}: {text}"))

    def recorded(self, record: Record) -> None:
        console.print(_record_line(record), soft_wrap=True)


def _record_line(r: Record) -> Text:
    from jaxlab.bench.record import case_label
    from jaxlab.bench.report import fmt_headline, fmt_value

    line = Text("  ")
    if r.ok:
        line.append("ok    ", style="green")
        line.append(f"{r.metric}  {case_label(r.case)}  ")
        line.append(f"median {fmt_value(r.stats.median, r.unit)}", style="bold")
        line.append(f"  n={len(r.samples)}  {fmt_headline(r.derived)}")
    else:
        line.append("FAIL  ", style="bold red")
        line.append(f"{r.metric}  {case_label(r.case)}: {r.error}")
    return line


def _print_summary(records: list[Record], title: str) -> None:
    """One table per suite (narrow enough for an 80-column log)."""
    from jaxlab.bench.record import case_label
    from jaxlab.bench.report import by_suite, fmt_headline, fmt_value

    console.print(Text(title, style="bold"))
    for suite_name, recs in by_suite(records).items():
        table = Table(title=suite_name, title_justify="left")
        for col in ("case", "metric", "median", "p90 / p99", "n", "figures"):
            table.add_column(col, overflow="fold")
        for r in recs:
            s = r.stats
            if not r.ok:
                tails = "-"
            elif s.tails_withheld:
                tails = "withheld"
            else:
                tails = f"{fmt_value(s.p90, r.unit)} / {fmt_value(s.p99, r.unit)}"
            table.add_row(
                case_label(r.case),
                r.metric.removesuffix("_time"),
                fmt_value(s.median, r.unit) if r.ok else Text("FAILED", style="bold red"),
                tails,
                str(len(r.samples)),
                fmt_headline(r.derived) if r.ok else (r.error or ""),
            )
        console.print(table)


# --------------------------------------------------------------------------- commands


def _run(
    names: list[str],
    *,
    quick: bool,
    config: str | None,
    set_: list[str] | None,
    out: Path | None,
    cpu: bool,
    json_: bool,
    profile: bool = False,
) -> BenchRun:
    from jaxlab.bench.suites import UnknownSuiteError, resolve_suites

    cfg = resolve(config, set_).config
    try:
        specs = resolve_suites(names)  # before jax starts: a typo costs nothing
    except UnknownSuiteError as e:
        raise UsageProblem(str(e)) from None
    for spec in specs:
        if spec.check is not None:
            spec.check(cfg)  # ConfigError: exit 2, before jax starts
    _check_unix_url(cfg.bench.serve_url, [s.name for s in specs])

    from jaxlab.bench.report import summary_rows
    from jaxlab.bench.suites import run_bench
    from jaxlab.runtime import apply_flag_config, configure_platform

    configure_platform("cpu" if cpu else cfg.runtime.platform)
    apply_flag_config(cfg.runtime)
    with _LiveReporter() as reporter:
        run = run_bench(names, config=cfg, quick=quick, out=out, reporter=reporter, profile=profile)
    _print_summary(run.records, f"jaxlab bench {run.run_id}")
    notes = run.report.notes if run.report else []
    for note in notes:
        console.print(Text(f"note: {note}", style="yellow"))
    console.print(Text(f"wrote {run.run_dir}"))
    if json_:
        emit_json(
            {
                "run_id": run.run_id,
                "out_dir": str(run.run_dir),
                "records": len(run.records),
                "failed": run.failed,
                "suites": run.suites,
                "summary": summary_rows(run.records),
                "notes": notes,
            }
        )
    if run.failed:
        console.print(Text(f"{run.failed} of {len(run.records)} records failed", style="bold red"))
        raise typer.Exit(EXIT_FAILURE)
    return run


def _check_unix_url(url: str | None, suites: list[str]) -> None:
    """``unix:PATH`` must name a socket that exists, before jax starts (exit 2)."""
    if url is None or not url.startswith("unix:") or "serve" not in suites:
        return
    import stat

    path = Path(url.removeprefix("unix:"))
    try:
        is_socket = stat.S_ISSOCK(path.stat().st_mode)
    except OSError as e:
        raise UsageProblem(f"--url {url}: {e.strerror or e}") from None
    if not is_socket:
        raise UsageProblem(f"--url {url}: {path} is not a unix socket")


@app.command("run", epilog="Example: jaxlab bench run peak compile --quick")
def run_cmd(
    suites: SuitesArg = None,
    quick: QuickOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    cpu: CpuOpt = False,
    url: UrlOpt = None,
    profile: ProfileOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Run suites; write records.jsonl, summary.csv, summary.md and plots/ under the run dir."""
    if url is not None:  # the last --set wins, so the flag overrides the config's value
        set_ = [*(set_ or []), f"bench.serve_url={url}"]
    _run(
        list(suites or []),
        quick=quick,
        config=config,
        set_=set_,
        out=out,
        cpu=cpu,
        json_=json_,
        profile=profile,
    )


@app.command("peak", epilog="Example: jaxlab bench peak --quick --json")
def peak_cmd(
    suites: Annotated[
        list[str] | None,
        typer.Argument(
            help="Further suites to run after the peak, in the same run.",
            autocompletion=_complete_suites,
            show_default=False,
        ),
    ] = None,
    quick: QuickOpt = False,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    cpu: CpuOpt = False,
    profile: ProfileOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Matmul GFLOP/s (float32, bfloat16) and memory GB/s of this device (the measured peak).

    `jaxlab bench peak SUITE...` measures the peak and then those suites in one run.
    """
    _run(
        ["peak", *(suites or [])],
        quick=quick,
        config=config,
        set_=set_,
        out=out,
        cpu=cpu,
        json_=json_,
        profile=profile,
    )


def _load(path: Path) -> list[Record]:
    from jaxlab.bench.record import RecordError, load_records

    try:
        return load_records(path)
    except RecordError as e:
        raise UsageProblem(str(e)) from None


def _compare_table(c: Comparison) -> Table:
    from jaxlab.bench.record import case_label
    from jaxlab.bench.report import fmt_value

    table = Table(
        title=f"B {', '.join(c.run_b)} relative to A {', '.join(c.run_a)}", title_justify="left"
    )
    for col in ("suite", "case", "metric", "A median", "B median", "B/A", "verdict"):
        table.add_column(col, overflow="fold")
    styles = {"faster": "green", "slower": "red", "noise": "dim", "failed": "bold red"}
    for r in c.rows:
        table.add_row(
            r.suite,
            case_label(r.case),
            r.metric,
            fmt_value(r.a_median, r.unit),
            fmt_value(r.b_median, r.unit),
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            Text(r.verdict, style=styles[r.verdict]),
        )
    return table


@app.command("compare", epilog="Example: jaxlab bench compare artifacts/benchmarks/A B --json")
def compare_cmd(
    a: Annotated[Path, typer.Argument(help="Run A (baseline): a run dir or records.jsonl.")],
    b: Annotated[Path, typer.Argument(help="Run B: a run dir or records.jsonl.")],
    json_: JsonOpt = False,
) -> None:
    """Ratio of medians B/A per (suite, case, metric), with noise marked."""
    from jaxlab.bench.compare import compare
    from jaxlab.bench.record import case_label

    result = compare(_load(a), _load(b))
    console.print(_compare_table(result))
    for side, items in (("only in A", result.only_a), ("only in B", result.only_b)):
        for item in items:
            console.print(
                Text(f"{side}: {item['suite']} {item['metric']} {case_label(item['case'])}")
            )
    for w in result.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))
    counts = result.counts()
    console.print(Text(", ".join(f"{v} {k}" for k, v in counts.items())))
    if json_:
        emit_json(result.to_dict())


@app.command("report", epilog="Example: jaxlab bench report artifacts/benchmarks/<run_id>")
def report_cmd(
    run_dir: Annotated[Path, typer.Argument(help="A run directory holding records.jsonl.")],
    json_: JsonOpt = False,
) -> None:
    """Rewrite summary.csv, summary.md and plots/ from a run's records.jsonl."""
    from jaxlab.bench.report import summary_rows, write_report

    records = _load(run_dir)
    if not run_dir.is_dir():
        raise UsageProblem(f"{run_dir}: expected a run directory")
    result = write_report(run_dir, records)
    _print_summary(records, f"jaxlab bench report {run_dir}")
    for note in result.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    if json_:
        emit_json(
            {
                "run_dir": str(run_dir),
                "records": len(records),
                "failed": sum(not r.ok for r in records),
                "files": [str(p) for p in result.files],
                "summary": summary_rows(records),
                "notes": result.notes,
            }
        )


@app.command(
    "results",
    epilog="Example: jaxlab bench results docs/benchmarks/<run_id> --out docs/results.md",
)
def results_cmd(
    run_dirs: Annotated[list[Path], typer.Argument(help="Committed record sets (run dirs).")],
    out: Annotated[Path, typer.Option("--out", help="The markdown file to write.")] = Path(
        "docs/results.md"
    ),
    readme: Annotated[
        Path | None, typer.Option("--readme", help="Also refresh this README's results block.")
    ] = Path("README.md"),
) -> None:
    """Generate the results document from record sets (no number typed by hand)."""
    from jaxlab.bench.record import RecordError
    from jaxlab.bench.results_doc import write_results

    for d in run_dirs:
        if not (d / "records.jsonl").is_file():
            raise UsageProblem(f"{d}: no records.jsonl (expected a benchmark run directory)")
    try:
        path = write_results(run_dirs, out, readme=readme)
    except RecordError as e:
        raise UsageProblem(str(e)) from None
    console.print(Text(f"wrote {path}"))


@app.command("list")
def list_cmd(json_: JsonOpt = False) -> None:
    """The registered suites."""
    from jaxlab.bench.suites import load_builtin_suites

    specs = list(load_builtin_suites().values())
    rows: list[dict[str, Any]] = [
        {
            "name": s.name,
            "default": s.default,
            "needs_peak": s.needs_peak,
            "description": s.description,
        }
        for s in specs
    ]
    if json_:
        emit_json({"suites": rows})
        return
    table = Table(title="jaxlab bench suites", title_justify="left")
    for col in ("suite", "in default run", "needs peak", "what"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            row["name"],
            "yes" if row["default"] else "no",
            "yes" if row["needs_peak"] else "no",
            row["description"],
        )
    console.print(table)
