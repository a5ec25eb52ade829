"""``jaxlab bench serve`` end to end: the real CLI starts real servers and loads them over HTTP.

Figures here are not judged (speed is the benchmark's business, not a test's); what is
checked is that every case the suite promises is measured, that nothing failed, and that
the derived numbers agree with the raw samples they came from.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.record import load_records


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serve")
    r = run_cli(
        "bench",
        "serve",
        "--quick",
        "--config",
        "bench-tiny",
        "--set",
        "inference.max_len=64",
        "--set",
        "inference.max_new_tokens=16",
        "--out",
        str(out),
        "--json",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    doc = r.json()
    return doc, load_records(Path(doc["out_dir"]))


@pytest.mark.slow
def test_every_case_is_measured_without_errors(serve_run):
    doc, records = serve_run
    assert doc["failed"] == 0 and doc["records"] == len(records)
    assert all(r.suite == "serve" and r.status == "ok" for r in records)
    e2e = [r for r in records if r.metric == "e2e_s"]
    closed = sorted(r.case["concurrency"] for r in e2e if r.case["mode"] == "closed")
    assert closed == [1, 4, 16]
    assert [r.case["load"] for r in e2e if r.case["mode"] == "poisson"] == [0.7]
    compare = {(r.case["slots"], r.case["sampling"]) for r in e2e if r.case["mode"] == "compare"}
    assert compare == {
        (16, "greedy"),
        (1, "greedy"),
        (16, "temperature=0.8"),
        (1, "temperature=0.8"),
    }
    for r in e2e:
        d = r.derived
        assert d["errors"] == 0 and d["error_kinds"] == {}, r.case
        assert d["requests"] == r.stats.n, "one e2e sample per request"
        assert d["requests_per_s"] == pytest.approx(d["requests"] / d["wall_s"])
        assert d["output_tokens_per_s"] > 0
        assert r.stats.median is not None and d["ttft_p50_s"] <= max(r.samples)
    # Each case also records TTFT, TPOT and the gaps between stream events.
    cases = {tuple(sorted(r.case.items())) for r in e2e}
    for metric in ("ttft_s", "tpot_s", "itl_s"):
        assert {tuple(sorted(r.case.items())) for r in records if r.metric == metric} == cases


@pytest.mark.slow
def test_cpu_use_is_measured_in_process_and_bounded_by_the_cores(serve_run):
    _, records = serve_run
    cores = os.cpu_count() or 1
    for r in (r for r in records if r.metric == "e2e_s"):
        used = r.derived["process_cpu_cores"]
        assert r.derived["cpu_count"] == cores
        # CPU time can exceed wall time only by running on several cores at once.
        assert 0 < used <= cores + 0.25, (r.case, used)


@pytest.mark.slow
def test_slot_speedup_is_the_ratio_of_the_rounds_it_summarises(serve_run):
    _, records = serve_run
    speedups = {r.case["sampling"]: r for r in records if r.metric == "slots_speedup"}
    assert set(speedups) == {"greedy", "temperature=0.8"}
    for sampling, rec in speedups.items():
        rounds = {
            r.case["slots"]: r
            for r in records
            if r.metric == "e2e_s"
            and r.case.get("sampling") == sampling
            and r.case["mode"] == "compare"
        }
        ratio = rounds[16].derived["output_tokens_per_s"] / rounds[1].derived["output_tokens_per_s"]
        assert rec.samples == [pytest.approx(ratio)], "--quick: one round per sampling mode"
        d = rec.derived
        assert rec.unit == "x" and d["target"] == 4.0
        assert d["meets_target"] is (min(rec.samples) >= 4.0)
        assert d["errors"] == 0
        assert d["output_tokens_per_s"] == pytest.approx(rounds[16].derived["output_tokens_per_s"])
        assert d["output_tokens_per_s_1slot"] == pytest.approx(
            rounds[1].derived["output_tokens_per_s"]
        )
        # The servers say how many slot groups they ran: the 1-slot one always one.
        assert d["decode_groups_1slot"] == rounds[1].derived["decode_groups"] == 1
        assert d["decode_groups"] == rounds[16].derived["decode_groups"] >= 1


@pytest.mark.slow
def test_url_measures_a_running_server_and_skips_the_slot_comparison(tmp_path):
    """``jaxlab bench serve --url``: the load goes to the server given (its request counter
    says so), every sweep and Poisson case is measured against it, and nothing else is
    started, so there is no 16-slot vs 1-slot comparison."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxlab.bench.serve_suite import _model, _serve_cfg
    from jaxlab.config import load_config
    from jaxlab.serve import ModelService, ServerThread

    sets = ["inference.max_len=64", "inference.max_new_tokens=16"]
    cfg = load_config("bench-tiny", sets, environ={})
    model = _model(cfg)
    service = ModelService.from_engine(model.engine, model.tokenizer, _serve_cfg(cfg, 4, 16))
    with ServerThread(service) as srv:
        srv.wait_ready()
        args = ["bench", "serve", "--quick", "--config", "bench-tiny"]
        for s in sets:
            args += ["--set", s]
        r = run_cli(*args, "--url", srv.url, "--out", str(tmp_path), "--json", timeout=600)
        assert r.returncode == 0, r.stderr
        served = sum(
            s.value
            for fam in text_string_to_metric_families(service.metrics.render().decode())
            for s in fam.samples
            if s.name == "jaxlab_requests_total" and s.labels == {"status": "200"}
        )
    records = load_records(Path(r.json()["out_dir"]))
    e2e = [x for x in records if x.metric == "e2e_s"]
    assert {x.case["mode"] for x in e2e} == {"closed", "poisson"}
    assert all(x.case["slots"] == "external" and x.status == "ok" for x in e2e)
    assert all(x.derived["errors"] == 0 for x in e2e)
    assert not [x for x in records if x.metric == "slots_speedup"]
    assert served == sum(x.derived["requests"] for x in e2e)


def test_url_must_be_http(tmp_path):
    r = run_cli("bench", "serve", "--url", "localhost:8000", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "bench.serve_url" in r.stderr and "localhost:8000" in r.stderr
