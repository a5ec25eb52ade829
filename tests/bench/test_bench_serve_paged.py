"""The pure pieces of the serve suite's paged cases: lengths, prompts, gap windows, peaks,
ratios and the servers' configs. The cases themselves run against the real server in
``test_bench_serve.py``."""

from __future__ import annotations

import pytest

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import RECORDS_FILENAME, Environment, RecordWriter
from jaxlab.bench.serve_interference import running_window, tokens_per_event, window_gaps
from jaxlab.bench.serve_paged import (
    REFERENCE_LEN,
    check_token_exact,
    paged_plan,
    paged_shapes,
    ratio,
)
from jaxlab.bench.serve_records import meets, ratio_record
from jaxlab.bench.serve_servers import pool_pages, serve_cfg
from jaxlab.config import JaxlabConfig, load_config
from jaxlab.serve.loadgen import (
    RequestResult,
    make_shared_prefix_prompts,
)
from jaxlab.tokenizer import byte_tokenizer


def make_ctx(tmp_path) -> BenchContext:
    ctx = BenchContext(
        config=JaxlabConfig(),
        quick=True,
        run_id="run-1",
        run_dir=tmp_path,
        env=Environment(devices={"platform": "cpu", "kind": "cpu", "count": 1}),
        writer=RecordWriter(tmp_path / RECORDS_FILENAME),
    )
    ctx.suite = "serve"
    return ctx


# --------------------------------------------------------------------------- lengths


def test_shapes_are_the_issues_at_256_tokens_and_scaled_below():
    full = paged_shapes(REFERENCE_LEN)
    assert (full.prefix_len, full.suffix_len, full.prefix_new) == (192, 16, 32)
    assert (full.memory_prompt, full.memory_new) == (32, 32)
    assert full.arrival_prompt == 224
    assert paged_shapes(1024) == full, "a longer cache keeps the issue's lengths"
    for max_len in (16, 64, 100, 128, 256, 512):
        s = paged_shapes(max_len)
        # Every request fits the cache: prompt + max_tokens <= max_len.
        assert s.prefix_len + s.suffix_len + s.prefix_new <= max_len
        assert s.memory_prompt + s.memory_new <= max_len
        assert s.stream_prompt + s.stream_new <= max_len
        assert s.arrival_prompt + s.arrival_new <= max_len
        assert min(vars(s).values()) >= 1


def test_quick_plan_is_smaller_but_leaves_cache_hits_possible():
    quick, full = paged_plan(True), paged_plan(False)
    assert (full.prefix_requests, full.prefix_concurrency) == (48, 16)
    assert quick.rounds < full.rounds and quick.prefix_requests < full.prefix_requests
    # Requests beyond the first wave arrive after the prefix was computed: they can hit.
    assert quick.prefix_requests > quick.prefix_concurrency


# --------------------------------------------------------------------------- prompts


def test_shared_prefix_prompts_are_token_exact_with_the_byte_tokenizer():
    prompts = make_shared_prefix_prompts(48, 192, 16, seed=3)
    tok = byte_tokenizer()
    check_token_exact(tok, prompts, 192, 16)
    ids = [tok.encode(p) for p in prompts]
    assert all(len(x) == 208 for x in ids)
    assert len({tuple(x[:192]) for x in ids}) == 1
    assert len({tuple(x[192:]) for x in ids}) == 48, "every suffix is its own"
    assert make_shared_prefix_prompts(48, 192, 16, seed=3) == prompts, "seeded"
    other = make_shared_prefix_prompts(48, 192, 16, seed=4)
    assert other[0][:192] != prompts[0][:192], "a new seed draws a new prefix"


def test_token_exactness_is_checked():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="not 20"):
        check_token_exact(tok, ["a" * 20, "b" * 19], 16, 4)
    with pytest.raises(ValueError, match="share their first 16"):
        check_token_exact(tok, ["a" * 20, "b" * 20], 16, 4)


# --------------------------------------------------------------------------- windows


def stream(times: list[float], tokens: int | None = None) -> RequestResult:
    return RequestResult(
        ok=True,
        status=200,
        t_start=0.0,
        t_end=times[-1],
        event_times=times,
        output_tokens=len(times) if tokens is None else tokens,
    )


def test_gaps_count_only_while_every_stream_runs():
    a = stream([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    b = stream([2.5, 3.5, 4.5, 5.5])
    window = running_window([a, b])
    assert window == (2.5, 5.5)
    gaps = window_gaps([a, b], (2.5, 5.5))
    # a: 3->4, 4->5 inside; b: all three gaps.
    assert sorted(gaps) == [1.0] * 5
    assert running_window([a, stream([7.0, 8.0])]) is None, "never together"
    assert running_window([a, RequestResult(ok=True, status=200, t_start=0, t_end=1)]) is None


def test_tokens_per_event_says_how_many_tokens_a_gap_spans():
    assert tokens_per_event([stream([1.0, 2.0], tokens=2)]) == 1.0
    assert tokens_per_event([stream([1.0, 2.0], tokens=3)]) == 1.5
    assert tokens_per_event([]) is None


# --------------------------------------------------------------------------- ratios


def test_ratio_handles_missing_sides():
    assert ratio(6.0, 2.0) == 3.0
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None


def test_targets_are_asked_of_every_round():
    assert meets([3.0, 3.5], 3.0, "higher") and not meets([2.9, 5.0], 3.0, "higher")
    assert meets([1.0, 2.0], 2.0, "lower") and not meets([1.0, 2.1], 2.0, "lower")
    assert not meets([], 1.0, "higher")


def test_ratio_record_carries_its_rounds_and_verdict(tmp_path):
    ctx = make_ctx(tmp_path)
    rec = ratio_record(ctx, "r", [3.2, 2.8], case={"mode": "m"}, target=3.0)
    assert rec.ok and rec.unit == "x" and rec.samples == [3.2, 2.8] and rec.better == "higher"
    assert rec.derived["target"] == 3.0 and rec.derived["target_is"] == "at least"
    assert rec.derived["meets_target"] is False
    low = ratio_record(ctx, "r", [1.5], case={}, target=2.0, better="lower")
    assert low.derived["meets_target"] is True and low.derived["target_is"] == "at most"
    bare = ratio_record(ctx, "r", [5.0], case={}, target=None, better="lower")
    assert "target" not in bare.derived and "meets_target" not in bare.derived
    failed = ratio_record(ctx, "r", [3.0, None], case={}, target=3.0, why_missing="no gauge")
    assert failed.status == "failed" and failed.error == "no gauge"


# --------------------------------------------------------------------------- servers' configs


def test_serve_cfg_applies_dotted_sets_and_validates():
    cfg = load_config("bench-small", [], environ={})
    c = serve_cfg(cfg, 64, 200, {"inference.num_pages": 256, "serve.prefix_caching": False})
    assert c.serve.slots == 64 and c.inference.num_pages == 256 and not c.serve.prefix_caching
    assert c.serve.max_tokens_limit >= 200
    # Today's memory: 16 slots x ceil(256 / 16) pages; num_pages when set.
    assert pool_pages(serve_cfg(cfg, 16, 32)) == 16 * 16
    assert pool_pages(c) == 256
    assert pool_pages(serve_cfg(cfg, 16, 32, {"inference.kv_cache_mib": 8.0})) is None
    with pytest.raises(KeyError):
        serve_cfg(cfg, 16, 32, {"model.n_layers": 2})
    with pytest.raises(ValueError, match="set one of them"):
        serve_cfg(cfg, 16, 32, {"inference.num_pages": 8, "inference.kv_cache_mib": 8.0})
