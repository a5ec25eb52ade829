"""The Typer application and the process entry point.

Commands import their heavy dependencies (jax, flax, optax, orbax) inside the command
body, so ``jaxlab --help``, ``jaxlab config ...`` and shell completion start fast.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Annotated

import typer

from jaxlab.cli import (
    bench_cmd,
    common,
    config_cmd,
    devices_cmd,
    generate_cmd,
    launch_cmd,
    reproduce_cmd,
    serve_cmd,
    train_cmd,
)
from jaxlab.cli.common import (
    EXIT_CODES_EPILOG,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    STATE,
    UsageProblem,
    console,
)

app = typer.Typer(
    name="jaxlab",
    help="jaxlab: a JAX/XLA training and inference systems lab.",
    epilog=EXIT_CODES_EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option(
            "--debug", help="Show tracebacks on errors, and the input signature of a recompile."
        ),
    ] = False,
    log_level: Annotated[
        str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")
    ] = "WARNING",
) -> None:
    STATE.debug = debug
    STATE.log_level = log_level.upper()
    if STATE.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise typer.BadParameter(
            f"got {log_level!r}, expected DEBUG, INFO, WARNING or ERROR", param_hint="--log-level"
        )
    common.configure_logging(STATE.log_level)
    # --debug also shows a recompile's whole input signature (logged at DEBUG).
    logging.getLogger("jaxlab.compile").setLevel(logging.DEBUG if debug else logging.NOTSET)


devices_cmd.register(app)
train_cmd.register(app)
generate_cmd.register(app)
launch_cmd.register(app)
reproduce_cmd.register(app)
serve_cmd.register(app)
app.add_typer(config_cmd.app, name="config")
app.add_typer(bench_cmd.app, name="bench")


def _fail(message: str, code: int) -> int:
    console.print(f"[bold red]error:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and map every outcome onto the documented exit codes."""
    from jaxlab.config import ConfigError

    try:
        rv = app(args=argv, prog_name="jaxlab", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # click's usage errors: bad option, missing argument
        show = getattr(e, "show", None)
        if show is not None:
            show(file=sys.stderr)
        return EXIT_USAGE
    except (typer.Abort, KeyboardInterrupt):
        console.print("interrupted")
        return EXIT_INTERRUPTED
    except ConfigError as e:
        if STATE.debug:
            traceback.print_exc()
        console.print("[bold red]config error[/]", markup=True)
        for issue in e.issues:
            console.print(f"  {issue}", markup=False, soft_wrap=True)
        return EXIT_USAGE
    except UsageProblem as e:
        return _fail(str(e), EXIT_USAGE)
    except Exception as e:
        if STATE.debug:
            traceback.print_exc()
            return EXIT_FAILURE
        return _fail(f"{type(e).__name__}: {e} (run with --debug for the traceback)", EXIT_FAILURE)


def run() -> None:
    """The process entry point (``jaxlab``, ``python -m jaxlab``)."""
    common.reserve_stdout()
    sys.exit(main())
