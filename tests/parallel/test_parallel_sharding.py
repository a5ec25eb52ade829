"""Sharded equals single-device: DP, FSDP, TP on simulated devices, resharding restore,
and two real processes over loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, CliResult, run_cli, with_xla_flags
from sharded_runs import SETS, STEPS

from jaxlab.config import load_config
from jaxlab.parallel import MeshError, mesh_shape

HERE = Path(__file__).parent
# Stated tolerance: sharded reductions sum in a different order than one device does.
# Losses agree to 1e-5 relative. Parameters agree to 1e-4 absolute after 5 AdamW steps
# at lr 3e-3: Adam divides by sqrt(v), which magnifies f32 rounding in tiny gradients,
# and 1e-4 is under 1% of the ~1.5e-2 a parameter can move in those steps.
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4


def run_meshes(out: Path, *meshes: str, devices: int, script: Path | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLAB_")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = with_xla_flags(f"--xla_force_host_platform_device_count={devices}")
    proc = subprocess.run(
        [sys.executable, str(script or HERE / "sharded_runs.py"), str(out), *meshes],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def load(out: Path, name: str):
    meta = json.loads((out / f"{name}.json").read_text())
    return meta, dict(np.load(out / f"{name}.npz"))


def assert_close(out: Path, ref: str, other: str) -> None:
    (m_ref, p_ref), (m, p) = load(out, ref), load(out, other)
    assert m_ref["losses"].keys() == m["losses"].keys()
    for step, loss in m_ref["losses"].items():
        np.testing.assert_allclose(
            m["losses"][step], loss, rtol=LOSS_RTOL, err_msg=f"{other} step {step}"
        )
    for k, v in p_ref.items():
        np.testing.assert_allclose(p[k], v, atol=PARAM_ATOL, err_msg=f"{other} {k}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    run_meshes(out, "1,1,1", devices=1)
    run_meshes(out, "8,1,1", "2,4,1", "4,1,2", "1,4,2", "restore:8,1,1>1,4,2", devices=8)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8x1x1", "2x4x1", "4x1x2", "1x4x2"])
def test_sharded_training_matches_single_device(runs, mesh):
    assert_close(runs, "1x1x1", mesh)


@pytest.mark.slow
def test_parameters_are_actually_sharded(runs):
    fsdp_tp, _ = load(runs, "1x4x2")
    dp, _ = load(runs, "8x1x1")
    assert any("fsdp" in s for s in fsdp_tp["specs"]) and any(
        "tensor" in s for s in fsdp_tp["specs"]
    )
    assert all("fsdp" not in s and "tensor" not in s for s in dp["specs"])


@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh(runs):
    assert_close(runs, "1x1x1", "restore_8x1x1-1x4x2")


def test_bad_meshes_name_the_dimension():
    p = load_config("tiny", ["parallel.data=2", "parallel.fsdp=2"], environ={}).parallel
    with pytest.raises(MeshError, match=r"2\*2\*1 = 4, but there are 8 devices"):
        mesh_shape(p, 8)
    p = load_config("tiny", ["parallel.tensor=3"], environ={}).parallel
    with pytest.raises(MeshError, match=r"parallel\.data: cannot fill the mesh"):
        mesh_shape(p, 8)
    assert mesh_shape(load_config("tiny", ["parallel.fsdp=4"], environ={}).parallel, 8) == {
        "data": 2,
        "fsdp": 4,
        "tensor": 1,
    }


@pytest.mark.slow
def test_devices_shows_mesh_and_rejects_bad_ones():
    env = {"XLA_FLAGS": with_xla_flags("--xla_force_host_platform_device_count=8")}
    r = run_cli("devices", "--json", "-c", "tiny", "--set", "parallel.tensor=2", env=env)
    assert r.returncode == 0, r.stderr
    assert r.json()["mesh"]["axes"] == {"data": 4, "fsdp": 1, "tensor": 2}
    r = run_cli(
        "devices", "-c", "tiny", "--set", "parallel.data=2", "--set", "parallel.fsdp=2", env=env
    )
    assert r.returncode == 2 and "but there are 8 devices" in r.stderr
    r = run_cli(
        "devices", "-c", "tiny", "--set", "parallel.tensor=8", "--set", "parallel.data=1", env=env
    )
    assert r.returncode == 2 and "does not divide model.n_heads" in r.stderr


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[CliResult, Path]:
    """``train --processes 2 --json``, data-parallel, the config of ``runs``: one launch
    for the losses test and the stdout test (``jaxlab launch -n 2``, the same launcher
    behind another command, is the dead-process test's)."""
    tmp = tmp_path_factory.mktemp("two-processes")
    sets = [f"runtime.artifacts_dir={tmp / 'art'}", *SETS, "parallel.data=2"]
    args = [x for s in sets for x in ("--set", s)]
    run = tmp / "two"
    r = run_cli(
        "train",
        "-c",
        "tiny",
        *args,
        "--steps",
        str(STEPS),
        "--processes",
        "2",
        "--run-dir",
        str(run),
        "--json",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r, run


@pytest.mark.slow
def test_two_real_processes_match_single_process(runs, two_processes):
    """Two processes, data-parallel: the losses of the single-device run of ``runs`` (the
    same config, trained by sharded_runs.py), step for step."""
    from jaxlab.train.run_dir import RunDir

    single, _ = load(runs, "1x1x1")
    a = {int(step): loss for step, loss in single["losses"].items()}
    b = RunDir(two_processes[1]).loss_history()
    assert a.keys() == b.keys() == set(range(1, STEPS + 1))
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=LOSS_RTOL)


@pytest.mark.slow
def test_a_dead_process_fails_the_others_fast(tmp_path):
    import signal
    import time

    from jaxlab.train.run_dir import RunDir

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLAB_")}
    env.update(JAX_PLATFORMS="cpu")
    run = tmp_path / "dies"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxlab",
            "launch",
            "-n",
            "2",
            "--",
            "train",
            "-c",
            "tiny",
            "--set",
            "parallel.data=2",
            "--set",
            "tokenizer.kind=byte",
            "--set",
            "model.vocab_size=258",
            "--set",
            f"runtime.artifacts_dir={tmp_path / 'art'}",
            "--set",
            "train.log_every_steps=1",
            "--steps",
            "100000",
            "--set",
            "train.steps=100000",
            "--run-dir",
            str(run),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not any(
        r.get("event") == "step" for r in RunDir(run).read_metrics()
    ):
        time.sleep(0.2)
    children = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) == 2
    os.kill(int(children[1]), signal.SIGKILL)  # process 1 dies mid-run
    t0 = time.time()
    _, err = launcher.communicate(timeout=120)
    assert time.time() - t0 < 60, "the surviving process hung"
    assert launcher.returncode == 137
    assert "process 1 exited with code -9" in err


@pytest.mark.slow
def test_two_processes_json_stdout_holds_one_document(two_processes):
    """``train --processes 2 --json``: whatever the native libraries print when the two
    processes connect (gloo's "[Gloo] Rank N is connected to ..." lines, written to fd 1
    from C++) goes to stderr; stdout is exactly the one JSON document of process 0."""
    r, run = two_processes
    doc = json.loads(r.stdout)  # the whole of stdout is one document
    assert doc["steps"] == STEPS and doc["run_dir"] == str(run)
    assert "Gloo" not in r.stdout
