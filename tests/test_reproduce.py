"""`jaxlab reproduce --cpu --quick` through the real CLI: every stage passes, evidence exists."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    report = (out / "report.md").read_text()
    assert "| serve | pass |" in report
    assert "![train and eval loss per step](loss.png)" in report and (out / "loss.png").is_file()
    bench = next(s for s in doc["stages"] if s["name"] == "bench")
    assert bench["details"]["plots"] and not bench["details"]["notes"]
    for plot in bench["details"]["plots"]:
        assert Path(plot).is_file() and f"]({Path(plot).relative_to(out)})" in report
    for s in doc["stages"]:
        for path in s["evidence"]:
            assert (out.parent / path).exists() or Path(path).exists(), path


def _doc(out: Path, plots: list[str], notes: list[str]) -> dict:
    stage = {"seconds": 1.0, "summary": "", "evidence": [], "error": None, "details": {}}
    bench = {"summary": str(out / "benchmarks" / "r1" / "summary.md"), "plots": plots}
    return {
        "ok": True,
        "quick": True,
        "total_s": 2.0,
        "stages": [
            {**stage, "name": "train", "status": "pass"},
            {**stage, "name": "bench", "status": "pass", "details": {**bench, "notes": notes}},
        ],
    }


def test_report_shows_the_loss_curve_and_links_the_benchmark_plots(tmp_path):
    from jaxlab.reproduce.report import render, write_loss_curve

    metrics = [{"event": "step", "step": s, "loss": 5.0 / s} for s in range(1, 11)]
    metrics.append({"event": "eval", "step": 10, "loss": 0.6})
    assert write_loss_curve(metrics, tmp_path / "loss.png") is None
    assert (tmp_path / "loss.png").stat().st_size > 0
    plot = str(tmp_path / "benchmarks" / "r1" / "plots" / "decode.png")
    md = render(_doc(tmp_path, [plot], []), tmp_path, loss_note=None)
    assert "## Loss curve\n\n![train and eval loss per step](loss.png)" in md
    assert "- [decode](benchmarks/r1/plots/decode.png)" in md
    assert "Summary: [summary.md](benchmarks/r1/summary.md)." in md


def test_report_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch):
    from jaxlab.bench.report import MATPLOTLIB_MISSING
    from jaxlab.reproduce.report import LOSS_CURVE_MISSING, render, write_loss_curve

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    note = write_loss_curve([{"event": "step", "step": 1, "loss": 1.0}], tmp_path / "loss.png")
    assert note == LOSS_CURVE_MISSING and "jaxlab[plots]" in note
    md = render(_doc(tmp_path, [], [MATPLOTLIB_MISSING]), tmp_path, loss_note=note)
    assert f"## Loss curve\n\n{LOSS_CURVE_MISSING}" in md
    assert f"Note: {MATPLOTLIB_MISSING}" in md
