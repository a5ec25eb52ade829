"""The serve suite's load records (``jaxlab.bench.serve_records.run_records``): a load every
request of which was answered gives its figures; a load with any failed request gives a
failed record naming what failed, never a throughput of the requests that happened to
finish (no server, no device: hand-made results)."""

from __future__ import annotations

from test_utilisation import CPU, context

from jaxlab.bench.serve_records import run_records
from jaxlab.serve.loadgen import LoadResult, RequestResult

CASE = {"mode": "closed", "concurrency": 2}


def answered(i: int) -> RequestResult:
    return RequestResult(
        ok=True, status=200, t_start=i, t_end=i + 1.0, ttft_s=0.1, event_times=[i + 0.1, i + 1.0],
        output_tokens=8, prompt_tokens=4,
    )  # fmt: skip


def test_a_wholly_served_load_gives_its_figures(tmp_path):
    ctx = context(tmp_path, CPU)
    ctx.suite = "serve"
    load = LoadResult([answered(0), answered(1)], wall_s=2.0)
    e2e, *rest = run_records(ctx, load, CASE, in_process=False)
    assert e2e.ok and e2e.metric == "e2e_s" and e2e.derived["errors"] == 0
    assert e2e.derived["output_tokens_per_s"] == 16 / 2.0
    assert {r.metric for r in rest} >= {"ttft_s", "tpot_s"}


def test_a_load_with_failed_requests_is_a_failed_record_naming_them(tmp_path):
    ctx = context(tmp_path, CPU)
    ctx.suite = "serve"
    timed_out = RequestResult(ok=False, status=504, t_start=0, t_end=60.0, error="timeout")
    cut = RequestResult(ok=False, status=200, t_start=0, t_end=60.0, error="stream ended")
    load = LoadResult([answered(0), timed_out, timed_out, cut], wall_s=60.0)
    (rec,) = run_records(ctx, load, CASE, in_process=False)
    assert not rec.ok and rec.metric == "e2e_s" and rec.samples == []
    error = rec.error or ""
    assert "3 of 4 requests failed" in error and "'504': 2" in error and "'200': 1" in error
    assert "output_tokens_per_s" not in rec.derived
