"""`jaxlab reproduce --cpu --quick` through the real CLI: every stage passes, evidence exists."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli


@pytest.mark.slow
def test_reproduce_quick_passes_every_stage(tmp_path):
    out = tmp_path / "rep"
    r = run_cli("reproduce", "--cpu", "--quick", "--out", str(out), "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    # the bench stage sweeps batch sizes: expected recompiles are no warning
    assert "recompiled" not in r.stderr and "WARNING" not in r.stderr, r.stderr[-4000:]
    doc = r.json()
    names = [s["name"] for s in doc["stages"]]
    assert names == [
        "devices",
        "configs",
        "train",
        "restore",
        "resume",
        "eval",
        "generate",
        "bench",
        "serve",
    ]
    assert all(s["status"] == "pass" for s in doc["stages"]), doc["stages"]
    assert json.loads((out / "report.json").read_text())["ok"] is True
    assert "| serve | pass |" in (out / "report.md").read_text()
    for s in doc["stages"]:
        for path in s["evidence"]:
            assert (out.parent / path).exists() or __import__("pathlib").Path(path).exists(), path
