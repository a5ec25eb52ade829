"""Conventions every command shares: output streams, options, errors, exit codes.

- Humans read stderr (Rich); ``--json`` puts exactly one JSON document on stdout.
- Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 130 interrupted,
  143 terminated.
- Rich honours ``NO_COLOR`` and falls back to plain lines when stderr is not a TTY.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

EXIT_CODES_EPILOG = (
    "Exit codes: 0 ok · 1 runtime failure · 2 usage or config error · "
    "130 interrupted (SIGINT) · 143 terminated (SIGTERM). "
    "Human output goes to stderr; --json prints one JSON document on stdout."
)


@dataclass
class GlobalState:
    debug: bool = False
    log_level: str = "WARNING"


STATE = GlobalState()

# Human-facing output: always stderr, so stdout stays clean for --json and TOML.
console = Console(stderr=True, highlight=False, soft_wrap=True)


class UsageProblem(Exception):
    """A usage mistake detected by a command (not by click): exit 2 with this message."""


def reserve_stdout() -> None:
    """Keep stdout for what the CLI means to print, whatever a native library prints.

    Native code writes to file descriptor 1 directly (gloo prints "[Gloo] Rank N is
    connected to ..." from C++ when a multi-process run starts), past ``sys.stdout``. After
    this call fd 1 is a copy of stderr, so that output lands among the human output, and
    ``sys.stdout`` writes to the original stdout through a descriptor of its own: the
    ``--json`` document, generated text, TOML and help still go there. For the process
    entry point only, and never undone: C stdio flushes its buffers at exit, to whatever
    fd 1 is then. Child processes inherit fd 1, i.e. stderr; one whose stdout matters gets
    ``sys.stdout`` explicitly (``jaxlab.parallel.launch``).
    """
    out = sys.stdout
    try:
        if out is None or out.fileno() != 1:
            return  # already redirected (a test's capture): nothing of ours to protect
        out.flush()
        data_fd = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no fd 1 or 2 (closed, or a stream without a descriptor)
        return
    data = open(data_fd, "w", encoding=out.encoding, errors=out.errors)  # noqa: SIM115
    data.reconfigure(
        line_buffering=bool(out.line_buffering),
        write_through=bool(getattr(out, "write_through", False)),
    )
    sys.stdout = data  # the process's stdout from here on


def emit_json(data: Any) -> None:
    """Write the one JSON document of a --json run to stdout."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def configure_logging(level: str) -> None:
    from rich.logging import RichHandler

    logging.basicConfig(
        level=level.upper(),
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False, rich_tracebacks=False)],
        force=True,
    )


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
ConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        help="Preset name (tiny, small, bench-tiny, bench-small, tpu-small, tpu-medium) or TOML "
        "path.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field: section.field=value (repeatable)."),
]


def checkpoint_step(value: str) -> str:
    """``--step`` of a run's checkpoints: 'latest' or a step number >= 0 (checked by click,
    before anything loads)."""
    if value == "latest" or (value.isascii() and value.isdigit()):
        return value
    raise typer.BadParameter(f"expected 'latest' or a step number >= 0 (got {value!r})")


def resolve(config: str | None, sets: list[str] | None):
    """The one loader, as every command calls it."""
    from jaxlab.config import resolve_config

    return resolve_config(config, sets or [])
