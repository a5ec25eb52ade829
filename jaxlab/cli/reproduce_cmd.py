"""``jaxlab reproduce``: prove the system end to end and leave auditable evidence."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jaxlab.cli.common import EXIT_FAILURE, JsonOpt, console, emit_json

if TYPE_CHECKING:
    from jaxlab.reproduce import StageResult

_STYLE = {
    "pass": "green",
    "fail": "bold red",
    "skip": "yellow",
    "running": "cyan",
    "pending": "dim",
}


class StageView:
    """A Rich live table of the stages on a TTY; one plain line per finished stage otherwise."""

    def __init__(self) -> None:
        self.rows: dict[str, StageResult] = {}
        self.live: Any = None

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title="jaxlab reproduce", title_justify="left")
        for col in ("stage", "status", "seconds", "what was checked"):
            t.add_column(col)
        for r in self.rows.values():
            style = _STYLE.get(r.status, "")
            what = r.summary or (r.error or "")
            t.add_row(
                r.name, f"[{style}]{r.status}[/]", f"{r.seconds:.1f}" if r.seconds else "", what
            )
        return t

    def on_stage(self, result: StageResult) -> None:
        self.rows[result.name] = result
        if self.live is not None:
            self.live.update(self.table())
        elif result.status not in ("running", "pending"):
            msg = result.summary if result.status != "fail" else result.error
            console.print(
                f"{result.name}: {result.status} ({result.seconds:.1f}s) {msg}", markup=False
            )


def register(app: typer.Typer) -> None:
    @app.command(epilog="Example: jaxlab reproduce --cpu --quick")
    def reproduce(
        cpu: Annotated[bool, typer.Option("--cpu", help="Force the CPU platform.")] = False,
        quick: Annotated[bool, typer.Option("--quick", help="Fewer steps and samples.")] = False,
        out: Annotated[
            Path | None,
            typer.Option("--out", help="Default artifacts/reproduce/<run_id>."),
        ] = None,
        json_: JsonOpt = False,
    ) -> None:
        """devices -> configs -> train -> restore -> resume -> eval -> generate -> bench -> serve."""
        from jaxlab.runtime import configure_platform

        if cpu:
            configure_platform("cpu")
        import logging

        logging.getLogger("absl").setLevel(logging.WARNING)
        from jaxlab.reproduce import STAGES, Chain, StageResult
        from jaxlab.train import new_run_id

        out_dir = out or Path("artifacts") / "reproduce" / new_run_id()
        out_dir.mkdir(parents=True, exist_ok=True)
        view = StageView()
        for name in STAGES:
            view.rows[name] = StageResult(name)
        chain = Chain(out_dir, quick=quick, observer=view)
        t0 = time.perf_counter()
        if console.is_terminal:
            from rich.live import Live

            with Live(view.table(), console=console, refresh_per_second=4) as live:
                view.live = live
                rep = chain.run()
        else:
            rep = chain.run()
        console.print(view.table())
        for note in chain.report_notes:
            console.print(f"note: {note}", markup=False, soft_wrap=True)
        console.print(
            f"{'PASS' if rep.ok else 'FAIL'} in {time.perf_counter() - t0:.1f}s; "
            f"report: {out_dir / 'report.md'} and {out_dir / 'report.json'}",
            markup=False,
        )
        if json_:
            emit_json(rep.to_json())
        if not rep.ok:
            raise typer.Exit(EXIT_FAILURE)
