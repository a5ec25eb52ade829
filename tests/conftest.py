"""Shared test helpers: run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


def clean_env() -> dict[str, str]:
    """This process's environment without ``JAXLAB_*``, on the CPU, uncoloured, unbuffered:
    what a test's subprocess runs with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLAB_")}
    env.update({"NO_COLOR": "1", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    return env


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
    python_flags: tuple[str, ...] = (),
) -> CliResult:
    """Run ``python -m jaxlab ARGS`` as a user would, with a clean JAXLAB_* environment."""
    base = clean_env()
    base.update(env or {})
    proc = subprocess.run(
        [sys.executable, *python_flags, "-m", "jaxlab", *args],
        capture_output=True,
        text=True,
        env=base,
        cwd=str(cwd or ROOT),
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli():
    return run_cli
