"""``jaxlab/bench/tpu_bench.sh``, the TPU measurement script, dry-run on the CPU with the tiny
preset: its phases run, the server on a unix socket gets ready, is loaded and drains, and
the record sets come back packed. (The TPU itself is never needed by CI.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

SCRIPT = ROOT / "jaxlab" / "bench" / "tpu_bench.sh"


def test_usage_without_a_phase_and_an_unknown_phase(tmp_path):
    env = {**clean_env(), "PYTHON": sys.executable, "TPU_BENCH_DIR": str(tmp_path)}
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "small" in r.stderr and "cpu-serve" in r.stderr
    assert "kernels" in r.stderr and "smoke" in r.stderr
    env |= {"TPU_BENCH_PLATFORM": "cpu", "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(SCRIPT), "fast"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown phase fast" in r.stderr


def dry_run(tmp_path: Path, phases: list[str], timeout: int, **env_extra: str) -> str:
    """Run ``phases`` of the script on the CPU with the tiny preset and --quick; the log,
    after checking the script exited 0. Its files are under ``tmp_path / "out"``."""
    out = tmp_path / "out"
    env = {
        **clean_env(),
        "PYTHON": sys.executable,
        "TPU_BENCH_PLATFORM": "cpu",
        "TPU_BENCH_SMALL": "tiny",
        "TPU_BENCH_ARGS": "--quick",
        "TPU_BENCH_DIR": str(tmp_path / "bench"),
        "OUT": str(out),
        **env_extra,
    }
    env.pop("JAX_PLATFORMS")  # the script's --set runtime.platform decides
    r = subprocess.run(
        ["bash", str(SCRIPT), *phases],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    log = (out / "tpu-bench.log").read_text()
    assert r.returncode == 0, log[-3000:]
    return log


@pytest.mark.slow
def test_the_flags_and_serve_phases_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    log = dry_run(
        tmp_path,
        ["flags", "serve"],
        1200,
        TPU_BENCH_FLAGS="--xla_tpu_scoped_vmem_limit_kib=65536",
        TPU_BENCH_BUDGET_S="900",
        TPU_BENCH_SERVE_CONCURRENCY="[4]",  # one level: the load's machinery, not a sweep
    )
    assert "server ready" in log and "server exit 0" in log and "skipped" not in log
    with tarfile.open(out / "tpu-bench-flags-serve.tgz") as tar:
        names = tar.getnames()
        sets = sorted({n.split("/")[0] for n in names})
        assert len(sets) == 3  # the preset alone, one flag set, and the server's load
        assert not [n for n in names if "/profile/" in n]
        tar.extractall(tmp_path / "unpacked", filter="data")
    metas = [json.loads((tmp_path / "unpacked" / s / "run.json").read_text()) for s in sets]
    flagged = [m for m in metas if "--xla_tpu_scoped_vmem_limit_kib=65536" in m["libtpu_init_args"]]
    assert len(flagged) == 1 and flagged[0]["suites"] == ["peak", "knobs"]
    assert [m["suites"] for m in metas].count(["serve"]) == 1
    (served,) = [s for s, m in zip(sets, metas, strict=True) if m["suites"] == ["serve"]]
    loads = (tmp_path / "unpacked" / served / "records.jsonl").read_text().splitlines()
    levels = {json.loads(x)["case"].get("concurrency") for x in loads}
    assert levels == {4}, levels  # TPU_BENCH_SERVE_CONCURRENCY reached the suite
    assert (out / "perfetto-knobs-step_time.json.gz").stat().st_size > 0
    doc = json.loads((out / "serve-cpu.json").read_text())
    assert doc["url"].startswith("unix:") and not os.path.exists(doc["uds"])
    assert "SIGTERM: drained" in (out / "serve-cpu.err").read_text()
    assert Path(SCRIPT).stat().st_mode & 0o111, "executable"


def test_the_smoke_phase_alone_says_it_needs_a_tpu(tmp_path):
    """``smoke`` runs only the Mosaic check, which a CPU run skips, saying why."""
    log = dry_run(tmp_path, ["smoke"], 120)
    assert "skipped tpu_kernel_smoke.py: it checks Mosaic, and this run is on cpu" in log
    assert "jaxlab bench" not in log and log.rstrip().endswith("done")


@pytest.mark.slow
def test_the_kernels_phase_dry_runs_on_the_cpu(tmp_path):
    """The paged-attention suite runs (paged_xla alone off the TPU) and comes back packed;
    the Mosaic smoke check is skipped, and the log says why."""
    out = tmp_path / "out"
    log = dry_run(tmp_path, ["kernels"], 600)
    assert "skipped tpu_kernel_smoke.py: it checks Mosaic, and this run is on cpu" in log
    with tarfile.open(out / "tpu-bench-kernels.tgz") as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    (run,) = sorted({n.split("/")[0] for n in names})
    meta = json.loads((tmp_path / "unpacked" / run / "run.json").read_text())
    assert meta["suites"] == ["peak", "paged-attention"]
    records = (tmp_path / "unpacked" / run / "records.jsonl").read_text().splitlines()
    paged = [json.loads(x) for x in records if '"paged-attention"' in x]
    assert paged and all(x["status"] == "ok" for x in paged)
    assert {x["case"]["kernel"] for x in paged} == {"paged_xla"}
