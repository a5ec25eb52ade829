"""Shared test helpers: run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SESSION_CACHE: str | None = None


#: LLVM's optimization level for the programs the tests compile (``XLA_FLAGS``).
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"


def pytest_configure(config: pytest.Config) -> None:
    """Two settings for the session, passed through the environment to this process and
    every subprocess (CLI or script) a test starts:

    * XLA:CPU compiles with LLVM at level 0 (:data:`FAST_COMPILE_FLAG`). The suite compiles
      hundreds of small programs and runs each only a few times, so LLVM's optimizations
      cost more than they save (docs/limitations.md gives the suite's time both ways).
      XLA's own HLO passes are the same at every level, as are the library dots (YNNPACK,
      Eigen) that do most of the arithmetic, and every invariant compares two programs
      compiled alike. ``TESTS_XLA_FAST_COMPILE=0``, or an ``XLA_FLAGS`` of your own that
      names the flag, compiles as jaxlab ships.
    * One JAX persistent compilation cache: the tests build the same small models again
      and again, and a hit loads the executable instead of compiling it. It starts empty,
      so every distinct program is still compiled once per run. ``TESTS_XLA_CACHE=0``
      turns it off; a ``JAX_COMPILATION_CACHE_DIR`` of your own is left alone."""
    global _SESSION_CACHE
    flags = os.environ.get("XLA_FLAGS", "")
    fast = os.environ.get("TESTS_XLA_FAST_COMPILE", "1") != "0"
    if fast and FAST_COMPILE_FLAG.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {FAST_COMPILE_FLAG}".strip()
    if os.environ.get("TESTS_XLA_CACHE", "1") == "0" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jaxlab-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


#: What one ``slow`` test weighs against an ordinary one when test files are ordered.
SLOW_WEIGHT = 25


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test files in order of expected cost, heaviest first: one per test, SLOW_WEIGHT
    per ``slow`` one (each file keeps its own order). Under ``--dist loadfile`` a worker
    takes the next file when two of its tests are left, so a heavy file handed out last
    keeps one worker busy while the other has nothing left to take; handed out early, the
    many light files fill the end of the run."""
    cost: dict[Path, int] = {}
    first: dict[Path, int] = {}
    for i, item in enumerate(items):
        cost[item.path] = cost.get(item.path, 0) + (
            SLOW_WEIGHT if item.get_closest_marker("slow") else 1
        )
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-cost[item.path], first[item.path]))


def pytest_sessionstart(session: pytest.Session) -> None:
    """xdist's loadfile would hand the files out by their number of tests alone (its
    ``--loadscope-reorder``, on by default): keep pytest_collection_modifyitems' order."""
    if getattr(session.config.option, "loadscopereorder", False):
        session.config.option.loadscopereorder = False


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


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


def with_xla_flags(*flags: str) -> str:
    """The session's ``XLA_FLAGS`` (see pytest_configure) followed by ``flags``: what a
    subprocess that needs flags of its own (simulated devices) runs with."""
    return " ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip()


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


#: Training steps of the tiny run the serving tests share; its one checkpoint is at this step.
RUN_STEPS = 30


def train_tiny(path: Path) -> None:
    """Train the ``tiny`` preset (byte tokenizer) for RUN_STEPS steps into the run dir ``path``."""
    from jaxlab.config import load_config
    from jaxlab.train.trainer import Trainer

    cfg = load_config(
        "tiny",
        [
            f"train.steps={RUN_STEPS}",
            f"checkpoint.every_steps={RUN_STEPS}",
            "tokenizer.kind=byte",
            "model.vocab_size=258",
            f"runtime.artifacts_dir={path.parent / 'artifacts'}",
        ],
        environ={},
    )
    trainer = Trainer(cfg, path)
    trainer.run()
    trainer.close()


def tiny_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's trained tiny run: trained by the first test that asks, shared after."""
    path = tmp_path_factory.getbasetemp() / "serve-run"
    if not (path / "checkpoints" / str(RUN_STEPS)).is_dir():
        train_tiny(path)
    return path
