"""``jaxlab bench serve`` end to end: the real CLI starts real servers and loads them over HTTP.

Figures here are not judged (speed is the benchmark's business, not a test's); what is
checked is that every case the suite promises is measured, that nothing failed, and that
the derived numbers agree with the raw samples they came from. The paged cases run with
``serve.prefill_chunk_tokens=16``, so that the quick run's arrivals (56 tokens at
``max_len`` 64) are prefilled in chunks.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import run_cli

from jaxlab.bench.record import Record, load_records

MAX_LEN = 64
PAGE_SIZE = 16  # inference.page_size's default
CHUNK = 16


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
        f"inference.max_len={MAX_LEN}",
        "--set",
        "inference.max_new_tokens=16",
        "--set",
        f"serve.prefill_chunk_tokens={CHUNK}",
        "--out",
        str(out),
        "--json",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    doc = r.json()
    return doc, load_records(Path(doc["out_dir"]))


def of(records: list[Record], metric: str, **case) -> list[Record]:
    """The records of ``metric`` whose case has every item of ``case``."""
    return [
        r
        for r in records
        if r.metric == metric and all(r.case.get(k) == v for k, v in case.items())
    ]


def one(records: list[Record], metric: str, **case) -> Record:
    found = of(records, metric, **case)
    assert len(found) == 1, (metric, case, [r.case for r in found])
    return found[0]


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
    says so), the sweep's level asked for (``bench.serve_concurrency``) and the Poisson case
    are measured against it, and nothing else is started, so there is no 16-slot vs 1-slot
    comparison."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxlab.bench.serve_servers import serve_cfg, served_model
    from jaxlab.config import load_config
    from jaxlab.serve import ModelService, ServerThread

    sets = ["inference.max_len=64", "inference.max_new_tokens=16"]
    # The sweep's prompts are 16 tokens: one bucket and chunk length for the server to warm.
    server_sets = [*sets, "inference.prefill_buckets=[16]", f"serve.prefill_chunk_tokens={CHUNK}"]
    cfg = load_config("bench-tiny", server_sets, environ={})
    model = served_model(cfg)
    service = ModelService.from_engine(model.engine, model.tokenizer, serve_cfg(cfg, 4, 16))
    with ServerThread(service) as srv:
        srv.wait_ready()
        args = ["bench", "serve", "--quick", "--config", "bench-tiny"]
        # One closed-loop level, the one the Poisson rate is a share of (bench.serve_concurrency).
        for s in [*sets, "bench.serve_concurrency=[16]"]:
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
    assert [x.case["concurrency"] for x in e2e if x.case["mode"] == "closed"] == [16]
    assert all(x.case["slots"] == "external" and x.status == "ok" for x in e2e)
    assert all(x.derived["errors"] == 0 for x in e2e)
    assert not [x for x in records if x.metric == "slots_speedup"]
    assert served == sum(x.derived["requests"] for x in e2e)
    # The records name the server's device (from its /ready), not only the client's.
    assert all(x.derived["server_platform"] == "cpu" for x in e2e)
    assert all(x.derived["server_slots"] == 4 and x.derived["server_kv_pages"] > 0 for x in e2e)


@pytest.mark.slow
def test_prefix_caching_case_compares_the_same_requests_with_the_cache_on_and_off(serve_run):
    _, records = serve_run
    on = one(records, "e2e_s", mode="prefix", prefix_caching=True)
    off = one(records, "e2e_s", mode="prefix", prefix_caching=False)
    # max_len 64 scales issue #33's 192 + 16 tokens and 32 new ones by a quarter.
    for side in (on, off):
        c = side.case
        assert (c["prefix_len"], c["suffix_len"], c["new_tokens"]) == (48, 4, 8)
        assert c["slots"] == 16 and c["num_pages"] == 16 * MAX_LEN // PAGE_SIZE
        assert c["prefill_chunk_tokens"] == CHUNK
        assert side.derived["errors"] == 0 and side.derived["requests"] == c["requests"] == 24
        assert side.derived["prompt_tokens"] == 24 * (48 + 4), "token-exact prompts"
        assert side.derived["kv_pages"] == c["num_pages"], "the same pool on both sides"
    # The cache hit, and only on the server that has one: full pages of the prefix.
    cached = on.derived["cached_tokens"]
    assert cached > 0 and cached % PAGE_SIZE == 0 and cached <= 24 * 48
    assert not off.derived["cached_tokens"]
    ttft = one(records, "prefix_cache_ttft_speedup")
    tput = one(records, "prefix_cache_throughput_speedup")
    assert ttft.samples == [pytest.approx(off.derived["ttft_p50_s"] / on.derived["ttft_p50_s"])]
    assert tput.samples == [
        pytest.approx(on.derived["output_tokens_per_s"] / off.derived["output_tokens_per_s"])
    ]
    for rec, target in ((ttft, 3.0), (tput, 1.5)):
        assert rec.unit == "x" and rec.better == "higher" and rec.case["rounds"] == 1
        assert rec.derived["target"] == target
        assert rec.derived["meets_target"] is (min(rec.samples) >= target)
        assert rec.derived["cached_tokens"] == [cached]


@pytest.mark.slow
def test_memory_case_gives_64_slots_the_pool_of_16(serve_run):
    _, records = serve_run
    pool = 16 * MAX_LEN // PAGE_SIZE
    paged = one(records, "e2e_s", mode="memory", slots=64)
    today = one(records, "e2e_s", mode="memory", slots=16)
    for side in (paged, today):
        assert side.case["num_pages"] == pool and side.case["concurrency"] == 64
        assert side.case["prefill_chunk_tokens"] == 0, "whole prompts: memory alone decides"
        assert (side.case["prompt_len"], side.case["new_tokens"]) == (8, 8)
        d = side.derived
        assert d["errors"] == 0 and d["scrape_errors"] == 0 and d["gauge_scrapes"] > 0
        assert d["preemptions"] is not None
        assert d["kv_pages"] == pool, "the pool the server reports, 64 slots or 16"
        assert 0 < d["running_peak"] <= side.case["slots"]
        assert d["pages_peak"] <= pool
    # Admission by memory: the pool of 16 slots held more than 16 of these requests at once.
    assert paged.derived["running_peak"] > 16
    conc = one(records, "paged_concurrency_ratio")
    assert conc.samples == [
        pytest.approx(paged.derived["running_peak"] / today.derived["running_peak"])
    ]
    tput = one(records, "paged_throughput_speedup")
    assert tput.samples == [
        pytest.approx(paged.derived["output_tokens_per_s"] / today.derived["output_tokens_per_s"])
    ]
    for rec, target in ((conc, 4.0), (tput, 1.5)):
        assert rec.derived["target"] == target
        assert rec.derived["meets_target"] is (min(rec.samples) >= target)


@pytest.mark.slow
def test_the_timeline_of_one_run_is_kept_and_drawn(serve_run):
    doc, records = serve_run
    rec = one(records, "pages_in_use", mode="memory", slots=64)
    series = rec.derived["timeline"]
    n = len(series["t_s"])
    assert n > 0 and len(series["running"]) == len(series["waiting"]) == n
    assert len(series["pages_used"]) == n and series["num_pages"] == 16 * MAX_LEN // PAGE_SIZE
    assert rec.samples == [p for p in series["pages_used"] if p is not None]
    assert max(rec.samples) <= series["num_pages"]
    assert series["t_s"] == sorted(series["t_s"])
    plot = Path(doc["out_dir"]) / rec.derived["plot"]
    assert plot.is_file() is (importlib.util.find_spec("matplotlib") is not None)


@pytest.mark.slow
def test_interference_case_measures_per_token_gaps_with_and_without_chunking(serve_run):
    _, records = serve_run
    for chunk in (CHUNK, 0):
        p99 = {}
        for arrivals in (False, True):
            rec = one(records, "running_itl_s", prefill_chunk_tokens=chunk, arrivals=arrivals)
            c, d = rec.case, rec.derived
            assert c["stream_chunk_tokens"] == 1 and c["streams"] == 8
            assert (c["arrival_prompt_len"], c["stream_new_tokens"]) == (56, 48)
            # One token per SSE event, but for a token ending mid UTF-8 character.
            assert 1.0 <= d["tokens_per_event"] < 1.2
            assert d["itl_p99_s"] == pytest.approx(rec.stats.p99)
            assert d["window_s"] > 0 and d["preemptions"] is not None
            if arrivals:
                assert d["arrivals"] > 0 and d["arrival_errors"] == 0
                assert d["arrival_interval_s"] > 0
            p99[arrivals] = d["itl_p99_s"]
        ratio = one(records, "interference_itl_p99_ratio", prefill_chunk_tokens=chunk)
        assert ratio.better == "lower"
        assert ratio.samples == [pytest.approx(p99[True] / p99[False])]
        if chunk:
            assert ratio.derived["target"] == 2.0
            assert ratio.derived["meets_target"] is (max(ratio.samples) <= 2.0)
        else:
            assert "target" not in ratio.derived, "the figure beside it has no target"


def test_url_must_be_http(tmp_path):
    r = run_cli("bench", "serve", "--url", "localhost:8000", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "bench.serve_url" in r.stderr and "localhost:8000" in r.stderr
