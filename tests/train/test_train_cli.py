"""Training through the real CLI: resume equals uninterrupted, SIGTERM, NaN abort, eval."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, run_cli

from jaxlab.checkpoint import Checkpointer
from jaxlab.train.run_dir import RunDir

pytestmark = pytest.mark.slow


def common(tmp_path: Path) -> list[str]:
    sets = [
        f"runtime.artifacts_dir={tmp_path / 'art'}",
        "tokenizer.kind=byte",
        "model.vocab_size=258",
        "data.synthetic_docs=400",
        "data.seq_len=32",
        "train.steps=40",
        "train.log_every_steps=1",
        "checkpoint.every_steps=5",
    ]
    return [x for s in sets for x in ("--set", s)]


def final_state(run_dir: Path, step: int | str = "latest"):
    ck = Checkpointer(run_dir / "checkpoints", read_only=True)
    state, meta = ck.restore(step, None)
    ck.close()
    return state, meta


def assert_same_run(full: Path, b: Path) -> None:
    """``b``'s latest checkpoint is ``full``'s at the same step, bitwise, and its losses are
    ``full``'s up to that step (``full`` may have trained on past it)."""
    sb, mb = final_state(b)
    sa, ma = final_state(full, mb["step"])
    assert ma["step"] == mb["step"]
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    losses = RunDir(b).loss_history()
    assert max(losses) == mb["step"]
    assert {k: v for k, v in RunDir(full).loss_history().items() if k <= mb["step"]} == losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """40 steps straight through (checkpoints every 5, all kept): what every interrupted
    run of this module must equal, at its own last step."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    full = tmp / "full"
    keep = ("--set", "checkpoint.keep_last=8")
    r = run_cli(
        "train", "-c", "tiny", *common(tmp), *keep, "--steps", "40", "--run-dir", str(full),
        "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return full, r.json()


def test_train_then_resume_equals_uninterrupted(uninterrupted, tmp_path):
    full, doc = uninterrupted
    split = tmp_path / "split"
    for key in (
        "run_dir",
        "steps",
        "final_loss",
        "tokens_per_s",
        "mfu",
        "compile_s",
        "checkpoints",
    ):
        assert key in doc
    assert doc["steps"] == 40 and doc["checkpoints"][-1] == 40
    assert (
        run_cli(
            "train", "-c", "tiny", *common(tmp_path), "--steps", "10", "--run-dir", str(split)
        ).returncode
        == 0
    )
    r = run_cli("resume", "--run-dir", str(split), "--steps", "20", "--json")
    assert r.returncode == 0, r.stderr
    assert r.json()["start_step"] == 10
    assert_same_run(full, split)
    for name in ("config.toml", "manifest.json", "metrics.jsonl", "tokenizer", "checkpoints"):
        assert (full / name).exists()

    r = run_cli("eval", "--run-dir", str(full), "--json")
    assert r.returncode == 0, r.stderr
    ev = r.json()
    assert ev["step"] == 40 and ev["tokens"] > 0 and ev["perplexity"] > 1
    assert run_cli("resume", "--run-dir", str(tmp_path / "nope")).returncode == 2
    assert run_cli("train", "-c", "tiny", *common(tmp_path), "--run-dir", str(full)).returncode == 2


def test_sigterm_saves_and_resume_equals_uninterrupted(uninterrupted, tmp_path):
    run = tmp_path / "term"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLAB_")}
    env.update(JAX_PLATFORMS="cpu", NO_COLOR="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxlab",
            "train",
            "-c",
            "tiny",
            *common(tmp_path),
            "--steps",
            "40",
            "--run-dir",
            str(run),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while time.time() < deadline:
        steps = [r for r in RunDir(run).read_metrics() if r.get("event") == "step"]
        if len(steps) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-2000:]
    assert f"jaxlab resume --run-dir {run}" in err
    saved = Checkpointer(run / "checkpoints", read_only=True).steps()
    assert saved and saved[-1] < 40
    r = run_cli("resume", "--run-dir", str(run), "--steps", "40")
    assert r.returncode == 0, r.stderr
    assert_same_run(uninterrupted[0], run)


def test_injected_nan_aborts_with_message_and_good_checkpoint(tmp_path):
    run = tmp_path / "nan"
    r = run_cli(
        "train",
        "-c",
        "tiny",
        *common(tmp_path),
        "--steps",
        "30",
        "--run-dir",
        str(run),
        "--set",
        "train.optimizer.learning_rate=1e30",
        "--set",
        "train.optimizer.clip_norm=0",
        "--set",
        "train.schedule.warmup_steps=0",
        "--set",
        "train.schedule.kind=constant",
    )
    assert r.returncode == 1, r.stderr
    assert "non-finite loss or gradient norm at step" in r.stderr
    assert "Traceback" not in r.stderr
    steps = Checkpointer(run / "checkpoints", read_only=True).steps()
    for s in steps:  # every checkpoint that exists is finite and restores
        ck = Checkpointer(run / "checkpoints", read_only=True)
        state, _ = ck.restore(s, None)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))
