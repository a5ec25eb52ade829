"""The real CLI in a subprocess: quick runs, both invocation forms, compare, exit codes."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.record import load_records
from jaxlab.config import config_hash, from_toml

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def imported_top_modules(stderr: str) -> set[str]:
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line)
        if m:
            names.add(m.group(1).split(".")[0])
    return names


def only_run_dir(out: Path) -> Path:
    (run_dir,) = list(out.iterdir())
    return run_dir


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-a")
    t0 = time.perf_counter()
    r = run_cli("bench", "peak", "tokenizer", "compile", "--quick", "--out", str(out), "--json")
    return r, out, time.perf_counter() - t0


@pytest.mark.slow
def test_quick_run_writes_valid_records_summaries_and_plots(quick_run):
    r, out, elapsed = quick_run
    assert r.returncode == 0, r.stderr
    assert elapsed < 60, f"a --quick run took {elapsed:.1f}s"
    doc = r.json()
    assert set(doc) >= {"run_id", "out_dir", "records", "failed", "summary"}
    run_dir = Path(doc["out_dir"])
    assert run_dir == only_run_dir(out) and run_dir.name == doc["run_id"]
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", doc["run_id"])
    assert doc["failed"] == 0 and doc["records"] == len(doc["summary"])
    for name in ("records.jsonl", "summary.csv", "summary.md"):
        assert (run_dir / name).is_file(), name
    # How the run was started, and the resolved config its records hash.
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["command"].startswith("jaxlab bench peak tokenizer compile --quick --out ")
    assert meta["suites"] == ["peak", "tokenizer", "compile"] and meta["quick"] is True
    saved = from_toml((run_dir / "config.toml").read_text())
    assert {config_hash(saved)} == {rec.config_hash for rec in load_records(run_dir)}
    assert {p.name for p in (run_dir / "plots").glob("*.png")} == {
        "peak.png",
        "tokenizer.png",
        "compile.png",
    }
    records = load_records(run_dir)  # validates every line
    assert len(records) == doc["records"]
    assert [r.suite for r in records[:3]] == ["peak"] * 3
    assert {r.suite for r in records} == {"peak", "tokenizer", "compile"}
    assert all(r.run_id == doc["run_id"] and r.status == "ok" for r in records)
    assert all(r.config_hash and r.devices.platform == "cpu" for r in records)
    gflops = {r.case["dtype"]: r.derived["gflops"] for r in records if r.metric == "matmul_time"}
    assert set(gflops) == {"float32", "bfloat16"} and all(v > 0 for v in gflops.values())
    assert any(r.metric == "copy_time" and r.derived["gb_per_s"] > 0 for r in records)
    steady = next(r for r in records if r.metric == "steady_call_time")
    assert steady.derived["mfu_peak_gflops"] == pytest.approx(gflops["float32"])
    assert steady.derived["mfu"] > 0
    compile_phases = {r.metric for r in records if r.suite == "compile"}
    assert {"trace_time", "lower_time", "compile_time", "first_call_time"} <= compile_phases
    assert "new_shape_first_call_time" in compile_phases
    assert all(r.stats.tails_withheld for r in records), "--quick takes < 20 samples"
    md = (run_dir / "summary.md").read_text()
    assert "withheld (n<20)" in md and "## tokenizer" in md
    # humans on stderr, one JSON document on stdout
    assert "suite peak" in r.stderr and "matmul_time" in r.stderr
    json.loads(r.stdout)


@pytest.mark.slow
def test_bare_suite_form_runs_peak_first_and_compare_works(quick_run, tmp_path):
    _, out_a, _ = quick_run
    out_b = tmp_path / "b"
    r = run_cli(
        "bench", "compile", "--quick", "--set", "bench.repeats=3", "--out", str(out_b), "--json"
    )
    assert r.returncode == 0, r.stderr
    doc = r.json()
    assert doc["suites"] == ["peak", "compile"], "compile needs the peak: it runs first"
    records = load_records(doc["out_dir"])
    assert records[0].suite == "peak" and all(len(x.samples) == 3 for x in records)

    r = run_cli("bench", "compare", str(only_run_dir(out_a)), doc["out_dir"], "--json")
    assert r.returncode == 0, r.stderr
    cmp = r.json()
    matched = {(row["suite"], row["metric"]) for row in cmp["rows"]}
    assert ("peak", "matmul_time") in matched and ("compile", "compile_time") in matched
    assert all(row["verdict"] in ("faster", "slower", "noise") for row in cmp["rows"])
    assert all(row["ratio"] > 0 for row in cmp["rows"])
    assert {x["suite"] for x in cmp["only_a"]} == {"tokenizer"}
    assert cmp["only_b"] == []
    assert "B/A" in r.stderr

    r = run_cli("bench", "report", doc["out_dir"], "--json")
    assert r.returncode == 0, r.stderr
    assert r.json()["records"] == len(records)


def test_usage_errors_exit_2_without_starting_jax(tmp_path):
    for args in (
        ("bench", "no-such-suite"),
        ("bench", "run", "no-such-suite"),
        ("bench", "--quick", "no-such-suite"),
    ):
        r = run_cli(*args, "--out", str(tmp_path), python_flags=("-X", "importtime"))
        assert r.returncode == 2, (args, r.stderr)
        assert "unknown suite 'no-such-suite'; known suites: peak, tokenizer, compile" in r.stderr
        assert not imported_top_modules(r.stderr) & set(HEAVY), args
    assert list(tmp_path.iterdir()) == [], "nothing is written for a usage error"
    r = run_cli("bench", "compare", str(tmp_path / "nope"), str(tmp_path / "nope2"))
    assert r.returncode == 2 and "no such records file" in r.stderr
    r = run_cli("bench", "run", "--no-such-flag")
    assert r.returncode == 2


def test_bench_help_and_list_never_import_jax():
    r = run_cli("bench", "--help", python_flags=("-X", "importtime"))
    assert r.returncode == 0
    assert not imported_top_modules(r.stderr) & set(HEAVY)
    for cmd in ("run", "peak", "compare", "report", "list"):
        assert cmd in r.stdout
    r = run_cli("bench", "list", "--json", python_flags=("-X", "importtime"))
    assert r.returncode == 0
    assert not imported_top_modules(r.stderr) & set(HEAVY)
    names = [s["name"] for s in json.loads(r.stdout)["suites"]]
    assert names[:3] == ["peak", "tokenizer", "compile"]


def test_a_failed_record_exits_1_after_writing_everything(tmp_path, capsys, monkeypatch):
    """In-process, with a suite registered only for this test."""
    import logging

    from jaxlab.bench import suites as registry
    from jaxlab.bench.timing import no_sync
    from jaxlab.cli.app import main

    def half_broken(ctx):
        yield ctx.bench("ok_time", lambda: 1, case={}, sync=no_sync)
        yield ctx.bench("bad_time", lambda: 1 / 0, case={}, sync=no_sync)

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # restored afterwards (--cpu sets it)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # main() reconfigures logging
    registry.suite("t-half-broken")(half_broken)
    try:
        code = main(["bench", "t-half-broken", "--cpu", "--out", str(tmp_path), "--json"])
    finally:
        registry.REGISTRY.pop("t-half-broken", None)
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["records"] == 2 and doc["failed"] == 1
    run_dir = Path(doc["out_dir"])
    statuses = [r.status for r in load_records(run_dir)]
    assert statuses == ["ok", "failed"]
    assert (run_dir / "summary.md").is_file() and (run_dir / "summary.csv").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("python", "says"),
    [
        ("", "bench.peer_python is not set"),
        ("/nonexistent/bin/python", "cannot be run (No such file or directory)"),
        (sys.executable, "cannot import torch and transformers (ModuleNotFoundError"),
    ],
    ids=["unset", "missing", "no-torch"],
)
def test_peer_without_a_usable_peer_python_is_one_clear_failure(tmp_path, python, says):
    """This environment has no torch (a test dependency it would be far too big to be)."""
    sets = ["--set", f"bench.peer_python={python}"] if python else []
    r = run_cli("bench", "peer", "--quick", *sets, "--out", str(tmp_path), "--json")
    assert r.returncode == 1, r.stderr
    records = load_records(only_run_dir(tmp_path))
    peer = [rec for rec in records if rec.suite == "peer"]
    assert len(peer) == 1 and peer[0].status == "failed", "checked once, before any case runs"
    error = peer[0].error or ""
    assert says in error and "torch==2.13.0 transformers" in error, error
    assert "Traceback" not in error
    assert all(rec.status == "ok" for rec in records if rec.suite == "peak")
