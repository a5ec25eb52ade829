"""``jaxlab launch -n N -- COMMAND ...``: N local processes, one JAX runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    @app.command(
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        epilog="Example: jaxlab launch -n 2 -- train --config tiny --steps 20 "
        "--set parallel.data=2",
    )
    def launch(
        ctx: typer.Context,
        n: Annotated[int, typer.Option("-n", "--processes", min=1, help="Processes to start.")] = 2,
        devices_per_process: Annotated[
            int | None,
            typer.Option(
                "--devices-per-process", min=1, help="Simulated CPU devices in each process."
            ),
        ] = None,
        log_dir: Annotated[
            Path | None,
            typer.Option("--log-dir", help="Logs of processes 1..N-1 (default: inherit)."),
        ] = None,
    ) -> None:
        """Run a jaxlab command in N processes over loopback (jax.distributed, gloo on CPU)."""
        from jaxlab.cli.common import UsageProblem
        from jaxlab.parallel.launch import launch as run_launch

        args = list(ctx.args)
        if args and args[0] == "--":
            args = args[1:]
        if not args:
            raise UsageProblem("launch: give the command to run after --, e.g. -- train -c tiny")
        code = run_launch(args, n, devices_per_process=devices_per_process, log_dir=log_dir)
        raise typer.Exit(code)
