"""``jaxlab train --profile START:STOP``: a jax.profiler trace of those steps in the run
directory; a bad spec exits 2 naming the option (before any work)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.train.run_dir import RunDir


def sets(tmp_path: Path) -> list[str]:
    values = [
        f"runtime.artifacts_dir={tmp_path / 'art'}",
        "tokenizer.kind=byte",
        "model.vocab_size=258",
        "data.synthetic_docs=200",
        "data.seq_len=32",
        "train.steps=3",
        "train.log_every_steps=1",
    ]
    return [x for v in values for x in ("--set", v)]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("2", "expected START:STOP"),
        ("a:3", "expected START:STOP"),
        ("-1:2", "expected START:STOP"),
        ("3:2", "START must be below STOP"),
        ("2:2", "START must be below STOP"),
        ("2:30", "must lie within this run's, 0:3"),
    ],
)
def test_bad_profile_specs_exit_2_naming_the_option(tmp_path, spec, why):
    run = tmp_path / "run"
    r = run_cli("train", "-c", "tiny", *sets(tmp_path), "--profile", spec, "--run-dir", str(run))
    assert r.returncode == 2, r.stderr
    assert "--profile" in r.stderr and why in r.stderr and "Traceback" not in r.stderr
    assert not run.exists()


@pytest.mark.slow
def test_a_tiny_cpu_train_writes_a_trace_of_the_steps_asked(tmp_path):
    run = tmp_path / "run"
    r = run_cli(
        "train", "-c", "tiny", *sets(tmp_path), "--profile", "2:3", "--run-dir", str(run), "--json"
    )
    assert r.returncode == 0, r.stderr
    traces = list((run / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert list((run / "profile").glob("plugins/profile/*/perfetto_trace.json.gz"))
    events = [m for m in RunDir(run).read_metrics() if m.get("event") == "profile"]
    assert events == [{"event": "profile", "steps": [2, 3], "dir": str(run / "profile")}]
    assert f"profiled steps 2:3 into {run / 'profile'}" in r.stderr
    # The MFU of every step names its denominator: on a CPU, a measured peak.
    basis = [m for m in RunDir(run).read_metrics() if m.get("event") == "mfu"]
    assert len(basis) == 1 and basis[0]["basis"].startswith("measured: float32 matmul")
    assert r.json()["mfu_basis"] == basis[0]["basis"]
    # A resumed run checks the steps against its own.
    r = run_cli("resume", "--run-dir", str(run), "--steps", "3", "--profile", "0:1")
    assert r.returncode == 2 and "--profile 0:1" in r.stderr and "Traceback" not in r.stderr
