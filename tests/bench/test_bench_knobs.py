"""The ``knobs`` suite, decode's bytes per step, ``--profile`` and the config's XLA flags, on
CPU through the real CLI (figures are not judged; what each record carries is)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.knobs import AS_CONFIGURED, check, default_variants, variants
from jaxlab.bench.record import load_records
from jaxlab.config import ConfigError, load_config
from jaxlab.model.remat import POLICIES


@pytest.mark.parametrize("preset", ["tpu-small", "tpu-medium"])
def test_the_default_sweep_changes_one_knob_at_a_time(preset):
    cfg = load_config(preset, environ={})
    vs = default_variants(cfg)
    check(cfg)  # every variant is a valid config
    assert vs[0] == "" and len(vs) == len(set(vs))
    remat = {v.split("=")[1] for v in vs if v.startswith("train.remat=")}
    assert remat == set(POLICIES) - {cfg.train.remat}
    assert f"model.scan_layers={str(not cfg.model.scan_layers).lower()}" in vs
    assert "train.precision.param_dtype=bfloat16 train.precision.master_dtype=float32" in vs
    b, a = cfg.train.batch_size, cfg.train.grad_accum_steps
    assert f"train.batch_size={2 * b} train.grad_accum_steps={2 * a}" in vs
    assert "train.loss_chunk_tokens=256" in vs  # the presets' 4,096 against the CPU's 256
    given = load_config(preset, ['bench.train_variants=["", "train.remat=full"]'], environ={})
    assert variants(given) == ["", "train.remat=full"]


def sweep(*items: str):
    return load_config("tiny", [f"bench.train_variants={json.dumps(list(items))}"], environ={})


def test_a_bad_variant_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"bench.train_variants 'train.remat=everything'"):
        check(sweep("train.remat=everything"))
    with pytest.raises(ConfigError, match=r"divisible by train\.grad_accum_steps"):
        check(sweep("train.grad_accum_steps=3"))  # tiny's batch is 8
    with pytest.raises(ConfigError, match="cannot vary between the cases"):
        sweep("runtime.xla_flags=[]")
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        sweep("remat")
    check(sweep("", "train.batch_size=7"))


def test_bench_knobs_usage_errors_exit_2_before_jax(tmp_path):
    r = run_cli(
        "bench",
        "knobs",
        "--set",
        'bench.train_variants=["train.remat=everything"]',
        "--out",
        str(tmp_path),
        python_flags=("-X", "importtime"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "bench.train_variants 'train.remat=everything'" in r.stderr
    mods = {
        m.group(1).split(".")[0]
        for line in r.stderr.splitlines()
        if (m := re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line))
    }
    assert "jaxlab" in mods and not mods & {"jax", "jaxlib", "flax"}
    assert not list(tmp_path.iterdir())
    r = run_cli("bench", "serve", "--url", f"unix:{tmp_path / 'no.sock'}", "--out", str(tmp_path))
    assert r.returncode == 2 and "--url unix:" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def knobs_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("knobs")
    variants = '["", "model.scan_layers=true train.remat=save_dots_no_batch"]'
    r = run_cli(
        "bench",
        "knobs",
        "decode",
        "--quick",
        "--config",
        "tiny",
        "--profile",
        "--set",
        f"bench.train_variants={variants}",
        "--set",
        'runtime.xla_flags=["--xla_force_host_platform_device_count=1"]',
        "--out",
        str(out),
        "--json",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.json()["out_dir"])
    return run_dir, load_records(run_dir)


@pytest.mark.slow
def test_each_knob_case_is_a_record_with_its_figures(knobs_run):
    _, records = knobs_run
    knobs = [r for r in records if r.suite == "knobs"]
    assert [r.case["variant"] for r in knobs] == [
        AS_CONFIGURED,
        "model.scan_layers=true train.remat=save_dots_no_batch",
    ]
    assert [(r.case["scan_layers"], r.case["remat"]) for r in knobs] == [
        (False, "none"),
        (True, "save_dots_no_batch"),
    ]
    for r in knobs:
        d = r.derived
        assert r.ok and r.metric == "step_time" and d["tokens_per_s"] > 0
        # Compile time apart from the samples, in stages; the step's memory.
        assert d["compile_total_s"] == pytest.approx(d["trace_s"] + d["lower_s"] + d["compile_s"])
        assert d["step_memory_bytes"] > 0 and d["params"] > 0
        # On a CPU: the measured peak is the one denominator, and it is named.
        assert d["mfu_basis"] == "measured" and d["mfu"] == d["mfu_measured"] > 0
        assert "matmul n=" in d["measured_peak"] and "mfu_datasheet" not in d


@pytest.mark.slow
def test_decode_records_carry_bytes_per_step_and_bandwidth(knobs_run):
    _, records = knobs_run
    decode = {r.case["batch"]: r for r in records if r.metric == "generate_s"}
    assert set(decode) == {1, 8}
    for batch, r in decode.items():
        d = r.derived
        assert d["bytes_per_step"] == pytest.approx(
            d["weight_bytes_per_step"] + d["kv_bytes_per_step"]
        )
        assert d["gb_per_s"] == pytest.approx(d["bytes_per_step"] / d["step_s"] / 1e9)
        assert d["bw_util_basis"] == "measured"
        assert d["bw_util"] == pytest.approx(d["gb_per_s"] / d["measured_gb_per_s"])
        assert d["kv_cache_bytes"] > 0 and d["measured_bandwidth"].startswith("float32 copy")
        if batch != 1:
            assert d["step_vs_batch1"] == pytest.approx(d["step_s"] / decode[1].derived["step_s"])


@pytest.mark.slow
def test_profile_and_flags_are_recorded(knobs_run):
    run_dir, records = knobs_run
    for r in records:
        if r.metric == "speculative_speedup":  # a ratio of two profiled records
            continue
        trace = run_dir / r.derived["profile"]
        assert list(trace.glob("plugins/profile/*/*.xplane.pb")), r.metric
        assert list(trace.glob("plugins/profile/*/perfetto_trace.json.gz")), r.metric
    meta = json.loads((run_dir / "run.json").read_text())
    assert "--xla_force_host_platform_device_count=1" in meta["xla_flags"].split()


def test_decode_records_name_the_steps_per_loop_trip_only_where_the_config_sets_them():
    """A record of a forced ``inference.decode_unroll`` says so in its case; a record of the
    platform's choice keeps the case earlier runs have."""
    from types import SimpleNamespace

    from jaxlab.bench.infer_suites import loop_case

    for given, case in ((None, {}), (1, {"decode_unroll": 1}), (2, {"decode_unroll": 2})):
        cfg = load_config(
            "tiny", [] if given is None else [f"inference.decode_unroll={given}"], environ={}
        )
        assert loop_case(SimpleNamespace(cfg=cfg)) == case
    with pytest.raises(ConfigError, match=r"inference\.decode_unroll"):
        load_config("tiny", ["inference.decode_unroll=0"], environ={})
