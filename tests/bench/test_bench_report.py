"""summary.csv / summary.md / plots from records; plots degrade without matplotlib."""

from __future__ import annotations

import csv
import sys

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import RECORDS_FILENAME, Environment, RecordWriter
from jaxlab.bench.report import MATPLOTLIB_MISSING, fmt_value, write_report
from jaxlab.config import JaxlabConfig


def write_run(tmp_path):
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=False,
        run_id="run-x",
        run_dir=tmp_path,
        env=Environment(devices={"platform": "cpu", "kind": "cpu", "count": 1}),
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    recs = []
    ctx.suite = "peak"
    recs.append(
        ctx.record("matmul_time", "s", [0.01] * 5, case={"op": "matmul", "dtype": "float32"},
                   derived={"gflops": 200.0})
    )  # fmt: skip
    recs.append(
        ctx.record("copy_time", "s", [0.02] * 25, case={"op": "copy"}, derived={"gb_per_s": 5.0})
    )
    ctx.suite = "other"
    recs.append(ctx.record("lat", "ms", [1.0, 2.0, 3.0], case={"k": "a|b"}))
    recs.append(ctx.record("lat", "ms", [], case={"k": "c"}, error="ValueError: nope"))
    for r in recs:
        ctx.writer.write(r)
    return recs


def test_summary_files_from_records_jsonl(tmp_path):
    write_run(tmp_path)
    result = write_report(tmp_path)  # reads records.jsonl itself
    csv_rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert len(csv_rows) == 4
    assert csv_rows[0]["suite"] == "peak" and float(csv_rows[0]["median"]) == 0.01
    assert csv_rows[0]["p90"] == "" and csv_rows[0]["tails_withheld"] == "True"
    assert csv_rows[1]["p99"] != "" and csv_rows[1]["tails_withheld"] == "False"
    assert csv_rows[3]["status"] == "failed" and csv_rows[3]["error"] == "ValueError: nope"
    md = (tmp_path / "summary.md").read_text()
    assert "## peak" in md and "## other" in md
    assert "withheld (n<20)" in md
    assert "| op=copy | copy_time | 20 ms | 20 ms | 20 ms |" in md
    assert "gflops=200" in md
    assert "k=a\\|b" in md, "pipes inside cells are escaped"
    assert "FAILED: ValueError: nope" in md
    assert "4 records, 1 failed." in md
    assert {p.name for p in result.plots} == {"peak.png", "other.png"}
    for p in result.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_are_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    recs = write_run(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = write_report(tmp_path, recs)
    assert result.plots == [] and result.notes == [MATPLOTLIB_MISSING]
    assert not (tmp_path / "plots").exists()
    assert MATPLOTLIB_MISSING in (tmp_path / "summary.md").read_text()


def test_fmt_value_scales_seconds():
    assert fmt_value(1.5, "s") == "1.5 s"
    assert fmt_value(0.0123, "s") == "12.3 ms"
    assert fmt_value(4.2e-6, "s") == "4.2 us"
    assert fmt_value(3e-9, "s") == "3 ns"
    assert fmt_value(None, "s") == "-"
    assert fmt_value(12.0, "MB/s") == "12 MB/s"
