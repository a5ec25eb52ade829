"""Generate docs/cli.md from the Typer app itself, so the reference cannot drift.

    python -m jaxlab.cli.reference > docs/cli.md

``tests/cli/test_cli_reference.py`` regenerates it and requires equality.
"""

from __future__ import annotations

import os
from typing import Any

import typer

from jaxlab.cli.app import app


def _walk(cmd: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    out = [(path, cmd)]
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if getattr(sub, "hidden", False):
            continue
        out += _walk(sub, [*path, name])
    return out


def reference() -> str:
    # Fixed width and no colour, so the output is the same on every terminal.
    os.environ["COLUMNS"] = "100"
    os.environ["NO_COLOR"] = "1"
    root = typer.main.get_command(app)
    parts = [
        "# CLI reference",
        "",
        "Generated from the Typer app by `python -m jaxlab.cli.reference > docs/cli.md`;",
        "a test regenerates it and fails on any difference.",
        "",
    ]
    for path, cmd in _walk(root, ["jaxlab"]):
        ctx = typer.Context(
            cmd, info_name=" ".join(path), terminal_width=100, max_content_width=100
        )
        parts += [f"## `{' '.join(path)}`", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(reference(), end="")
