"""Resume, eval, generate and serve on a run whose newest checkpoint is damaged.

A tiny run is trained once for this module (checkpoints at steps 10 and 20). Every way of
damaging step 20 makes ``resume`` continue from step 10, bitwise equal to resuming from step
10 on purpose; the CLI commands say so on one line of stderr; ``--step 20`` fails clearly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from ckpt_damage import DAMAGE, flip_bytes_everywhere
from conftest import ROOT, clean_env, run_cli

from jaxlab.checkpoint import Checkpointer
from jaxlab.config import JaxlabConfig, load_config
from jaxlab.train.run_dir import RunDir
from jaxlab.train.trainer import Trainer

pytestmark = pytest.mark.slow

NOTE = "checkpoint step 20 is unreadable ("


def tiny_cfg(root: Path) -> JaxlabConfig:
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={root / 'art'}",
            "tokenizer.kind=byte",
            "model.vocab_size=258",
            "data.synthetic_docs=200",
            "data.seq_len=32",
            "train.steps=30",
            "train.log_every_steps=5",
            "train.eval_batches=1",
            "checkpoint.every_steps=10",
        ],
        environ={},
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[JaxlabConfig, Path]:
    root = tmp_path_factory.mktemp("damaged-resume")
    cfg = tiny_cfg(root)
    with Trainer(cfg, root / "run") as t:
        t.run(stop_at=20)
    with Checkpointer(root / "run" / "checkpoints", read_only=True) as ck:
        assert ck.steps() == [10, 20]
    return cfg, root / "run"


@pytest.fixture(scope="module")
def reference(trained, tmp_path_factory: pytest.TempPathFactory):
    """Resume from step 10 on purpose, to step 30: what every fallback must reproduce."""
    cfg, run = trained
    copy = tmp_path_factory.mktemp("reference") / "run"
    shutil.copytree(run, copy)
    with Trainer(cfg, copy) as t:
        assert t.restore(10) == 10
        t.run(stop_at=30)
    return jax.device_get(t.state), RunDir(copy).loss_history()


def damaged_copy(run: Path, dest: Path, kind: str) -> Path:
    shutil.copytree(run, dest)
    DAMAGE[kind](dest / "checkpoints" / "20")
    return dest


def assert_bitwise(state, expected) -> None:
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(expected), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_resume_on_a_damaged_latest_equals_resuming_from_the_step_before(
    trained, reference, tmp_path, kind
):
    cfg, run = trained
    copy = damaged_copy(run, tmp_path / "run", kind)
    with Trainer(cfg, copy) as t:
        assert t.restore("latest") == 10
        assert t.restored is not None and t.restored.note is not None
        assert t.restored.note.startswith(NOTE) and t.restored.note.endswith("; using step 10")
        summary = t.run(stop_at=30)
    state, losses = reference
    assert_bitwise(jax.device_get(t.state), state)
    assert RunDir(copy).loss_history() == losses
    # The damaged step was set aside (bytes kept) and written again by the resumed run.
    assert (copy / "checkpoints" / "unreadable" / "20").is_dir()
    assert summary.checkpoints == [10, 20, 30]
    with Checkpointer(copy / "checkpoints", read_only=True) as ck:
        assert ck.restore_intact("latest", lambda s: ck.restore_meta(s)).skipped == ()


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_resume_cli_falls_back_bitwise_and_says_so_once(trained, tmp_path):
    """Through the CLI (whose runtime settings differ from this process's, so the reference
    is the CLI's own ``resume --step 10``)."""
    _, run = trained
    on_purpose = tmp_path / "on-purpose"
    shutil.copytree(run, on_purpose)
    r = run_cli("resume", "--run-dir", str(on_purpose), "--step", "10", "--steps", "30")
    assert r.returncode == 0, r.stderr
    copy = damaged_copy(run, tmp_path / "run", "flip-array-bytes")
    r = run_cli("resume", "--run-dir", str(copy), "--steps", "30", "--json")
    assert r.returncode == 0, r.stderr
    notes = [line for line in stderr_lines(r.stderr) if "is unreadable" in line]
    assert len(notes) == 1 and notes[0].startswith(NOTE), r.stderr
    assert notes[0].endswith("; using step 10")
    assert "Traceback" not in r.stderr
    doc = r.json()
    assert doc["start_step"] == 10 and [s["step"] for s in doc["skipped_checkpoints"]] == [20]
    with (
        Checkpointer(copy / "checkpoints", read_only=True) as ck,
        Checkpointer(on_purpose / "checkpoints", read_only=True) as ref,
    ):
        assert_bitwise(ck.restore(30, None)[0], ref.restore(30, None)[0])
    assert RunDir(copy).loss_history() == RunDir(on_purpose).loss_history()


@pytest.fixture(scope="module")
def damaged_run(trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One damaged copy for the read-only commands (they must leave it as it is): bytes
    flipped all over every array file, so the params-only restore of inference meets them."""
    dest = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(trained[1], dest)
    flip_bytes_everywhere(dest / "checkpoints" / "20")
    return dest


def test_generate_and_eval_fall_back_with_one_line(damaged_run):
    before = sorted(p.name for p in (damaged_run / "checkpoints").iterdir())
    r = run_cli(
        "generate",
        "--run-dir",
        str(damaged_run),
        "--prompt",
        "The",
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert stderr_lines(r.stderr)[0].startswith(NOTE) and "Traceback" not in r.stderr
    doc = r.json()
    assert doc["checkpoint_step"] == 10 and doc["skipped_checkpoints"][0]["step"] == 20

    r = run_cli("eval", "--run-dir", str(damaged_run), "--json")
    assert r.returncode == 0, r.stderr
    notes = [line for line in stderr_lines(r.stderr) if "is unreadable" in line]
    assert len(notes) == 1 and notes[0].startswith(NOTE) and "Traceback" not in r.stderr
    doc = r.json()
    assert doc["step"] == 10 and doc["skipped_checkpoints"][0]["step"] == 20
    assert np.isfinite(doc["loss"])
    assert sorted(p.name for p in (damaged_run / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("command", ["resume", "eval", "generate", "serve"])
def test_an_explicit_damaged_step_fails_clearly(damaged_run, command):
    extra = {"generate": ["--prompt", "x"], "serve": ["--port", "0"]}.get(command, [])
    r = run_cli(command, "--run-dir", str(damaged_run), "--step", "20", *extra)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    last = stderr_lines(r.stderr)[-1]
    assert NOTE in last and "restore another step (10)" in last
    if command != "serve":  # serve's log also reports the failed load, before this line
        assert len(stderr_lines(r.stderr)) == 1, r.stderr


def test_serve_falls_back_with_one_line(damaged_run, tmp_path):
    port_file = tmp_path / "port"
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxlab",
                "serve",
                "--run-dir",
                str(damaged_run),
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--slots",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=clean_env(),
            cwd=ROOT,
        )
        try:
            deadline = time.monotonic() + 180
            while "ready:" not in err_path.read_text():
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    text = err_path.read_text()
    notes = [line for line in stderr_lines(text) if "is unreadable" in line]
    assert len(notes) == 1 and notes[0].startswith(NOTE), text
    assert "(step 10," in text and "Traceback" not in text


KILL_DURING_FIRST_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from jaxlab.config import from_toml
    from jaxlab.train.trainer import Trainer, TrainObserver

    class KillOnFirstSave(TrainObserver):
        def on_checkpoint(self, step):
            os.kill(os.getpid(), signal.SIGKILL)  # the async save is in flight right now

    cfg = from_toml(open(sys.argv[2]).read())
    Trainer(cfg, sys.argv[1], observer=KillOnFirstSave()).run(stop_at=20)
    """
)


def test_resume_after_sigkill_during_the_first_save_is_one_line(tmp_path):
    """No finalized checkpoint, only Orbax's temporary directory: resume says so in one line
    (exit 2), with no traceback from Orbax's clean-up thread at interpreter exit."""
    from jaxlab.config import to_toml

    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(to_toml(tiny_cfg(tmp_path)))
    run = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_FIRST_SAVE, str(run), str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
    with Checkpointer(run / "checkpoints", read_only=True) as ck:
        assert ck.steps() == []
    r = run_cli("resume", "--run-dir", str(run))
    assert r.returncode == 2, r.stderr
    assert stderr_lines(r.stderr) == [f"error: no finalized checkpoint in {run / 'checkpoints'}"], (
        r.stderr
    )
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
