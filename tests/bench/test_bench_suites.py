"""Registry, runner and MFU plumbing, in-process with a fake environment (no device)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxlab.bench import suites as registry
from jaxlab.bench.context import BenchContext, mfu
from jaxlab.bench.peak import peak_gflops
from jaxlab.bench.record import (
    RECORDS_FILENAME,
    Environment,
    Record,
    RecordWriter,
    load_records,
)
from jaxlab.bench.suites import UnknownSuiteError, resolve_suites, run_bench, suite
from jaxlab.bench.timing import no_sync
from jaxlab.config import JaxlabConfig

ENV = Environment(
    versions={"jax": "test"},
    devices={"platform": "cpu", "kind": "cpu", "count": 1},
    cpu={"model": "test cpu", "cores": 2},
)


@pytest.fixture
def temp_suites():
    added: list[str] = []

    def add(name: str, fn, **kw):
        suite(name, **kw)(fn)
        added.append(name)

    yield add
    for name in added:
        registry.REGISTRY.pop(name, None)


def test_unknown_suite_names_the_known_ones():
    with pytest.raises(UnknownSuiteError) as e:
        resolve_suites(["peak", "tokeniser"])
    msg = str(e.value)
    assert "'tokeniser'" in msg
    for known in ("peak", "tokenizer", "compile"):
        assert known in msg


def test_resolution_order_puts_peak_first_and_defaults_exclude_serve():
    assert [s.name for s in resolve_suites(["compile"])] == ["peak", "compile"]
    assert [s.name for s in resolve_suites(["tokenizer", "peak", "tokenizer"])] == [
        "peak",
        "tokenizer",
    ]
    assert [s.name for s in resolve_suites(["tokenizer"])] == ["tokenizer"]
    everything = [s.name for s in resolve_suites([])]
    assert everything[0] == "peak" and "serve" not in everything and "peer" not in everything
    assert {"tokenizer", "compile"} <= set(everything)


def test_reserved_names_are_refused():
    for bad in ("run", "compare", "list", "report", "", "--x"):
        with pytest.raises(ValueError):
            suite(bad)


def test_failing_case_becomes_a_failure_record_and_the_run_goes_on(tmp_path, temp_suites):
    def flaky(ctx: BenchContext) -> Iterator[Record]:
        yield ctx.bench("fine", lambda: 1, case={"i": 0}, sync=no_sync)

        def boom():
            raise RuntimeError("kernel exploded")

        yield ctx.bench("broken", boom, case={"i": 1}, sync=no_sync)
        yield ctx.bench("after", lambda: 2, case={"i": 2}, sync=no_sync)
        raise OSError("suite body died")

    temp_suites("t-flaky", flaky)
    run = run_bench(["t-flaky"], config=JaxlabConfig(), quick=True, out=tmp_path, env=ENV)
    metrics = [(r.metric, r.status) for r in run.records]
    assert metrics == [
        ("fine", "ok"),
        ("broken", "failed"),
        ("after", "ok"),
        ("suite_error", "failed"),
    ]
    assert run.failed == 2
    broken = run.records[1]
    assert broken.error is not None and "RuntimeError: kernel exploded" in broken.error
    assert "OSError: suite body died" in (run.records[3].error or "")
    # everything is on disk, validated, and summarised
    on_disk = load_records(run.run_dir)
    assert [r.metric for r in on_disk] == [m for m, _ in metrics]
    assert (run.run_dir / "summary.md").read_text().count("FAILED") == 2
    assert "kernel exploded" in (run.run_dir / "summary.csv").read_text()


def test_derive_errors_are_failures_not_crashes(tmp_path, temp_suites):
    def bad_derive(ctx):
        yield ctx.bench("t", lambda: 1, case={}, sync=no_sync, derive=lambda s: {"x": 1 / 0})

    temp_suites("t-derive", bad_derive)
    run = run_bench(["t-derive"], config=JaxlabConfig(), quick=True, out=tmp_path, env=ENV)
    (rec,) = run.records
    assert rec.status == "failed" and "ZeroDivisionError" in (rec.error or "")


def test_quick_caps_repeats_and_config_sets_them(tmp_path, temp_suites):
    def count(ctx):
        yield ctx.bench("t", lambda: 1, case={}, sync=no_sync)

    temp_suites("t-count", count)
    cfg = JaxlabConfig.model_validate({"bench": {"repeats": 30, "warmup": 0}})
    quick = run_bench(["t-count"], config=cfg, quick=True, out=tmp_path, env=ENV)
    full = run_bench(["t-count"], config=cfg, quick=False, out=tmp_path, env=ENV)
    assert len(quick.records[0].samples) == 5 and quick.records[0].stats.tails_withheld
    assert len(full.records[0].samples) == 30 and full.records[0].stats.p99 is not None
    assert quick.run_dir.parent == full.run_dir.parent == tmp_path
    assert quick.run_id != full.run_id


def test_default_out_dir_follows_config(tmp_path, temp_suites, monkeypatch):
    temp_suites("t-empty", lambda ctx: iter(()))
    monkeypatch.chdir(tmp_path)
    cfg = JaxlabConfig.model_validate({"runtime": {"artifacts_dir": "arts"}})
    run = run_bench(["t-empty"], config=cfg, out=None, env=ENV)
    assert run.run_dir.parent == Path("arts") / "benchmarks"
    assert (tmp_path / run.run_dir).is_dir()
    assert (run.run_dir / RECORDS_FILENAME).read_text() == ""
    cfg = JaxlabConfig.model_validate({"bench": {"out_dir": "elsewhere"}})
    run = run_bench(["t-empty"], config=cfg, env=ENV)
    assert run.run_dir.parts[0] == "elsewhere"


def _peak_record(ctx: BenchContext, dtype: str, gflops: float, n: int = 64) -> Record:
    ctx.suite = "peak"
    return ctx.record(
        "matmul_time", "s", [0.1], case={"op": "matmul", "dtype": dtype, "n": n},
        derived={"gflops": gflops},
    )  # fmt: skip


def test_mfu_uses_the_peak_of_the_same_run(tmp_path, temp_suites):
    """A suite computes MFU against the peak records already in this run."""

    def model(ctx: BenchContext):
        flops_per_call = 4e9
        yield ctx.bench(
            "step_time",
            lambda: None,
            case={},
            sync=no_sync,
            derive=lambda s: ctx.mfu(flops_per_call / 0.5, dtype="float32"),
        )
        yield ctx.record("bf16", "s", [1.0], case={}, derived=ctx.mfu(25e9, dtype="bfloat16"))

    temp_suites("t-model", model)

    def fake_peak(ctx: BenchContext):
        yield _peak_record(ctx, "float32", 16.0)
        yield _peak_record(ctx, "bfloat16", 50.0)

    # stand in for the real peak suite: this test needs no device
    real = registry.REGISTRY["peak"]
    registry.REGISTRY["peak"] = registry.SuiteSpec("peak", fake_peak)
    try:
        run = run_bench(["t-model"], config=JaxlabConfig(), quick=True, out=tmp_path, env=ENV)
    finally:
        registry.REGISTRY["peak"] = real
    by_metric = {r.metric: r for r in run.records}
    assert [r.suite for r in run.records] == ["peak", "peak", "t-model", "t-model"]
    step = by_metric["step_time"]
    assert step.derived["mfu"] == pytest.approx(8e9 / 16e9)
    assert step.derived["mfu_peak_gflops"] == 16.0 and step.derived["mfu_peak_dtype"] == "float32"
    assert by_metric["bf16"].derived["mfu"] == pytest.approx(0.5)
    assert peak_gflops(run.records, "float32") == 16.0
    assert peak_gflops(load_records(run.run_dir), "bfloat16") == 50.0


def test_mfu_without_peak_says_why(tmp_path):
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="r",
        run_dir=tmp_path,
        env=ENV,
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    out = ctx.mfu(1e9)
    assert out["mfu"] is None and "no ok float32 matmul peak" in out["mfu_note"]
    ctx.records.append(_peak_record(ctx, "float32", 0.5))
    assert ctx.mfu(1e9)["mfu"] == pytest.approx(2.0)
    assert "MFU > 1" in ctx.mfu(1e9)["mfu_note"]
    assert ctx.mfu(1e9, devices=4)["mfu"] == pytest.approx(0.5)
    assert ctx.mfu(1e9, devices=4)["mfu_devices"] == 4
    assert mfu(1e9, None) is None and mfu(1e9, 10.0) == pytest.approx(0.1)


def test_peak_gflops_is_the_best_measured_and_ignores_failures(tmp_path):
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="r",
        run_dir=tmp_path,
        env=ENV,
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    recs = [
        _peak_record(ctx, "float32", 10.0, n=512),
        _peak_record(ctx, "float32", 20.0, n=1024),
        _peak_record(ctx, "float32", 15.0, n=2048),  # larger, slower: the best figure wins
    ]
    ctx.suite = "peak"
    recs.append(
        ctx.record("matmul_time", "s", [], case={"op": "matmul", "dtype": "float32", "n": 4096},
                   error="oom")
    )  # fmt: skip
    assert peak_gflops(recs, "float32") == 20.0
    assert peak_gflops(recs, "bfloat16") is None
    assert json.loads(recs[-1].to_json_line())["status"] == "failed"
