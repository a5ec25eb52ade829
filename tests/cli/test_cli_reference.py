"""docs/cli.md is generated from the Typer app; it must match the app exactly."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_cli_reference_is_current():
    out = subprocess.run(
        [sys.executable, "-m", "jaxlab.cli.reference"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    ).stdout
    assert out == (ROOT / "docs" / "cli.md").read_text(), (
        "docs/cli.md is stale: run `python -m jaxlab.cli.reference > docs/cli.md`"
    )
    for cmd in (
        "devices",
        "config validate",
        "train",
        "resume",
        "eval",
        "merge",
        "generate",
        "bench",
        "serve",
        "reproduce",
        "launch",
    ):
        assert f"## `jaxlab {cmd}`" in out, cmd
