"""MFU and bandwidth utilisation: both denominators, each named, and the arithmetic (no
device: fake environments and peak records)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxlab.bench.context import BenchContext
from jaxlab.bench.infer_suites import decode_bytes
from jaxlab.bench.peak import peak_gb_per_s, peak_gflops
from jaxlab.bench.record import RECORDS_FILENAME, Environment, Record, RecordWriter
from jaxlab.config import JaxlabConfig
from jaxlab.runtime.datasheet import DATASHEETS, datasheet_for

TPU = Environment(
    versions={"jax": "test"},
    devices={"platform": "tpu", "kind": "TPU v5 lite", "count": 1},
    cpu={"model": "test cpu", "cores": 13},
)
CPU = Environment(
    versions={"jax": "test"},
    devices={"platform": "cpu", "kind": "cpu", "count": 1},
    cpu={"model": "test cpu", "cores": 2},
)


def context(tmp_path: Path, env: Environment) -> BenchContext:
    return BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="r",
        run_dir=tmp_path,
        env=env,
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )


def add_peak(ctx: BenchContext, metric: str, case: dict, **derived: float) -> Record:
    suite, ctx.suite = ctx.suite, "peak"
    rec = ctx.record(metric, "s", [0.1], case=case, derived={**derived, "quick": True})
    ctx.suite = suite
    ctx.records.append(rec)
    return rec


def matmul(ctx: BenchContext, dtype: str, n: int, gflops: float) -> Record:
    return add_peak(ctx, "matmul_time", {"op": "matmul", "dtype": dtype, "n": n}, gflops=gflops)


def test_the_v5e_datasheet_and_no_other_guess():
    sheet = DATASHEETS["TPU v5 lite"]
    assert sheet.matmul_gflops("bfloat16") == 197_000.0 and sheet.memory_gb_per_s == 819.0
    assert sheet.matmul_gflops("float32") is None  # no datasheet figure: f32 runs as bf16 passes
    assert datasheet_for("cpu") is None and datasheet_for(None) is None
    assert "cloud.google.com" in sheet.source
    r = subprocess.run(
        [sys.executable, "-c", "import sys, jaxlab.runtime.datasheet; print('jax' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.strip() == "False"


def test_on_a_tpu_mfu_divides_by_the_datasheet_with_the_measured_peak_beside_it(tmp_path):
    ctx = context(tmp_path, TPU)
    matmul(ctx, "bfloat16", 4096, 92_000.0)
    matmul(ctx, "bfloat16", 8192, 150_000.0)
    out = ctx.mfu(98.5e12, dtype="bfloat16")
    assert out["mfu_basis"] == "datasheet" and out["mfu"] == out["mfu_datasheet"]
    assert out["mfu_datasheet"] == pytest.approx(0.5)
    assert out["datasheet_peak_gflops"] == 197_000.0 == out["mfu_peak_gflops"]
    assert out["datasheet"] == "TPU v5e datasheet, bfloat16: 197 TFLOP/s"
    # The measured figure beside it: the best matmul of the run, named.
    assert out["mfu_measured"] == pytest.approx(98.5e12 / 150e12)
    assert out["measured_peak_gflops"] == 150_000.0
    assert out["measured_peak"] == "bfloat16 matmul n=8192, median of 1, run r (--quick)"
    assert "mfu_note" not in out
    # Several devices: the datasheet per chip, times the chips.
    assert ctx.mfu(98.5e12, dtype="bfloat16", devices=2)["mfu"] == pytest.approx(0.25)


def test_float32_on_a_tpu_has_no_datasheet_figure(tmp_path):
    ctx = context(tmp_path, TPU)
    matmul(ctx, "float32", 8192, 50_000.0)
    out = ctx.mfu(25e12, dtype="float32")
    assert out["mfu_basis"] == "measured" and out["mfu"] == pytest.approx(0.5)
    assert "mfu_datasheet" not in out and "datasheet" not in out


def test_on_a_cpu_the_best_measured_peak_is_the_only_denominator(tmp_path):
    ctx = context(tmp_path, CPU)
    matmul(ctx, "float32", 1024, 120.0)
    matmul(ctx, "float32", 2048, 100.0)  # larger but slower: the best figure wins
    out = ctx.mfu(60e9)
    assert out["mfu_basis"] == "measured" and out["mfu"] == out["mfu_measured"] == 0.5
    assert out["mfu_peak_gflops"] == out["measured_peak_gflops"] == 120.0
    assert "n=1024" in out["measured_peak"]
    assert not {"mfu_datasheet", "datasheet", "datasheet_peak_gflops"} & set(out)
    assert peak_gflops(ctx.records, "float32") == 120.0


def test_bandwidth_against_both_denominators(tmp_path):
    ctx = context(tmp_path, TPU)
    add_peak(ctx, "copy_time", {"op": "copy", "dtype": "float32", "mib": 1024}, gb_per_s=700.0)
    out = ctx.bandwidth(409.5e9)
    assert out["gb_per_s"] == pytest.approx(409.5)
    assert out["bw_util_basis"] == "datasheet" and out["bw_util"] == pytest.approx(0.5)
    assert out["datasheet_gb_per_s"] == 819.0
    assert out["bw_util_measured"] == pytest.approx(409.5 / 700.0)
    assert out["measured_bandwidth"].startswith("float32 copy of 1024 MiB (read + write)")
    assert peak_gb_per_s(ctx.records) == 700.0
    # A read alone faster than the copy: it becomes the measured bandwidth, named as a read.
    add_peak(ctx, "copy_time", {"op": "read", "dtype": "bfloat16", "mib": 1024}, gb_per_s=780.0)
    out = ctx.bandwidth(409.5e9)
    assert out["bw_util_measured"] == pytest.approx(409.5 / 780.0)
    assert out["measured_bandwidth"].startswith("bfloat16 read of 1024 MiB (a column sum)")
    assert out["bw_util"] == pytest.approx(0.5)  # the datasheet stays the headline
    assert peak_gb_per_s(ctx.records) == 780.0
    cpu = context(tmp_path / "cpu", CPU)
    add_peak(cpu, "copy_time", {"op": "copy", "dtype": "float32", "mib": 64}, gb_per_s=20.0)
    out = cpu.bandwidth(10e9)
    assert out["bw_util_basis"] == "measured" and out["bw_util"] == pytest.approx(0.5)
    assert "bw_util_datasheet" not in out


def test_decode_bytes_are_the_weights_plus_the_visible_kv(tmp_path):
    """Bytes a decode step reads: every weight once, and each row's K and V up to its
    position; the rate is those bytes over one step's time."""
    ctx = context(tmp_path, TPU)
    add_peak(ctx, "copy_time", {"op": "copy", "dtype": "float32", "mib": 1024}, gb_per_s=800.0)
    # 2 layers x K and V x 4 kv heads x 16 dims x 2 bytes = 512 bytes a position; 64 slots.
    engine = SimpleNamespace(
        step_weight_bytes=10_000_000, cache_bytes_per_slot=512 * 64, max_len=64
    )
    out = decode_bytes(ctx, engine, batch=4, prompt_len=32, new_tokens=17, decode_s=0.016)
    assert out["step_s"] == pytest.approx(0.001)  # 16 decode steps after the prefill's token
    visible = 32 + 17 / 2  # positions 32 .. 47 attend to 33 .. 48 slots: 40.5 on average
    assert out["kv_bytes_per_step"] == pytest.approx(4 * visible * 512)
    assert out["bytes_per_step"] == pytest.approx(10_000_000 + 4 * visible * 512)
    assert out["kv_cache_bytes"] == 4 * 512 * 64
    assert out["gb_per_s"] == pytest.approx(out["bytes_per_step"] / 0.001 / 1e9)
    assert out["bw_util_datasheet"] == pytest.approx(out["gb_per_s"] / 819.0)
    assert out["bw_util_measured"] == pytest.approx(out["gb_per_s"] / 800.0)


def test_mfu_records_validate_and_keep_both_denominators(tmp_path):
    ctx = context(tmp_path, TPU)
    ctx.suite = "train"
    matmul(ctx, "bfloat16", 8192, 160_000.0)
    rec = ctx.record("step_time", "s", [0.5], case={}, derived=ctx.mfu(50e12, dtype="bfloat16"))
    ctx.emit(rec)
    line = (tmp_path / RECORDS_FILENAME).read_text().splitlines()[-1]
    assert '"mfu_datasheet"' in line and '"mfu_measured"' in line and '"mfu_basis"' in line


@pytest.mark.parametrize("impl", ["xla_cpu", "xla_tpu", "xla", "reference"])
def test_a_slots_cache_bytes_are_what_each_kernel_allocates(impl):
    import jax
    from flax import nnx

    from jaxlab.config import load_config
    from jaxlab.infer import Engine

    sets = [f"model.attention_impl={impl}", "train.precision.compute_dtype=bfloat16"]
    engine = Engine.from_config(load_config("tiny", sets, environ={}))
    model = nnx.merge(engine.graphdef, engine.params)
    cache = jax.eval_shape(lambda: model.init_cache(1, engine.max_len))
    assert engine.cache_bytes_per_slot == sum(
        a.size * a.dtype.itemsize for a in jax.tree.leaves(cache)
    )
