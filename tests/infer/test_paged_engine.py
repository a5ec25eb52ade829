"""The engine over a paged cache: every way a sequence can reach its pages gives the tokens
that prefilling its whole prompt at once gives.

Chunked prefill (random splits, several sequences per call at different starts), a prompt
prefix already in pages (prefix caching), a preempted request recomputed with a
``generated`` offset, done rows whose freed pages another request now holds, the pool's
sizing, and the compile counts a sweep of chunk shapes may cost. The reference is offline
generation (one whole-prompt chunk per request), itself checked against the cache-free
baseline, for greedy and seeded sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_engines import (
    VOCAB,
    Host,
    greedy,
    main_engine,
    make_engine,
    req,
    tiny_cfg,
    variant_engine,
)

from jaxlab.config import InferenceConfig
from jaxlab.infer import Chunk, Engine, SamplingParams, generate
from jaxlab.infer.chunks import row_bucket
from jaxlab.runtime import tuning

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
#: Every prefill of these tests pads to one length bucket: the compiles then depend on the
#: row bucket and the kind of prefill only, and hypothesis examples share them.
BUCKET = 32


@functools.cache
def small_pages_engine() -> Engine:
    """Pages of 4 tokens (8 per row of 32): a prompt spans many pages."""
    return make_engine(tiny_cfg(2, 32, [8, 32], 1, page_size=4))


ENGINES = {"pages-of-16": main_engine, "pages-of-4": small_pages_engine}


def sampled(seed: int, n: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, top_k=50, seed=seed)


def splits_of(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    """``[0, n)`` cut at ``cuts`` (each in ``1 .. n - 1``) into consecutive runs."""
    edges = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    return list(itertools.pairwise(edges))


# ----------------------------------------------------------------- reference: offline path


def test_offline_paged_generation_equals_the_cache_free_baseline_when_sampling():
    """Seeded sampling, ragged prompts: the paged engine and the full-prefix baseline draw
    the same tokens (greedy is checked logit by logit in test_infer_engine.py)."""
    eng = variant_engine(1)
    reqs = [  # two rows: the shapes of test_infer_engine's baseline test
        req([4] * 17, sampled(12, 5), eng),
        req([9], SamplingParams(max_new_tokens=7, temperature=1.2, top_p=0.8, seed=3), eng),
    ]
    cached, naive = generate(eng, reqs), generate(eng, reqs, kv_cache=False)
    assert [r.token_ids for r in cached] == [r.token_ids for r in naive]


# ------------------------------------------------------------------------ chunked prefill


@SETTINGS
@example(cuts=[[5], [1, 2, 3], []], seed=0)
@given(
    cuts=st.lists(st.lists(st.integers(1, 29), max_size=3), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_chunked_prefill_equals_whole_prompts(cuts, seed):
    """Three prompts split at random points; each round, one prefill call computes every
    unfinished prompt's next chunk (different starts in one call, a chunk from 0 beside
    chunks from further on, last and not-last chunks, padding rows). ``insert`` takes only
    the rows whose prompt ended. Then decoding: each request equals offline generation.
    Pages of 4 tokens: a prompt spans up to 6 of them, chunks start mid-page."""
    eng = small_pages_engine()
    rng = np.random.default_rng(seed)
    lengths = [24, 12, 20]
    reqs = [
        req(rng.integers(0, VOCAB, n).tolist(), greedy(4) if i != 1 else sampled(seed), eng)
        for i, n in enumerate(lengths)
    ]
    expected = [r.token_ids for r in generate(eng, reqs)]

    host = Host(eng)
    pages = {}
    for i, r in enumerate(reqs):
        got = host.pool.admit(i, r.prompt_ids, reserve=r.sampling.max_new_tokens)
        assert got is not None
        pages[i] = got.pages
    plan = {i: splits_of(lengths[i], cuts[i]) for i in range(3)}
    out: dict[int, list[int]] = {i: [] for i in range(3)}
    while any(plan.values()):
        todo = [i for i in range(3) if plan[i]]
        chunks = []
        for i in todo:
            a, b = plan[i].pop(0)
            p = reqs[i].prompt_ids
            chunks.append(Chunk(p[a:b], a, pages[i], reqs[i].sampling, last=b == len(p)))
        host.state, pre = eng.prefill(host.state, chunks, bucket=BUCKET)
        first = np.asarray(pre.tokens)
        for row, (i, c) in enumerate(zip(todo, chunks, strict=True)):
            if c.last:
                out[i].append(int(first[row]))
        host.state = eng.insert(pre, host.state, todo)  # not-last rows are skipped
    host.drain(out)
    assert [out[i] for i in range(3)] == expected


# -------------------------------------------------------------- a prefix already in pages


@pytest.mark.parametrize("which", list(ENGINES))
@SETTINGS
@given(shared=st.integers(1, 25), seed=st.integers(0, 2**16))
def test_a_prompt_whose_prefix_is_in_pages_equals_its_whole_prefill(which, shared, seed):
    """Prompt A is prefilled and its full pages committed; prompt B shares A's first
    ``shared`` tokens, so the pool lends B A's cached pages and B's prefill starts past
    them (``start > 0``, reading A's pages). B decodes as if prefilled whole."""
    eng = ENGINES[which]()
    rng = np.random.default_rng(seed)
    a_ids = rng.integers(0, VOCAB, 28).tolist()
    b_ids = a_ids[:shared] + rng.integers(0, VOCAB, 28 - shared).tolist()
    ra, rb = req(a_ids, greedy(3), eng), req(b_ids, sampled(seed, 3), eng)
    expected = generate(eng, [rb])[0].token_ids

    host = Host(eng, prefix_caching=True)
    got_a = host.pool.admit("a", a_ids, reserve=3)
    assert got_a is not None
    chunk = Chunk(a_ids, 0, got_a.pages, ra.sampling)
    host.state, _ = eng.prefill(host.state, [chunk], bucket=BUCKET)
    host.pool.commit("a", a_ids, len(a_ids))
    got_b = host.pool.admit("b", b_ids, reserve=3)
    assert got_b is not None
    assert got_b.cached_tokens == (shared // eng.page_size) * eng.page_size
    start = got_b.cached_tokens
    chunk = Chunk(b_ids[start:], start, got_b.pages, rb.sampling)
    host.state, pre = eng.prefill(host.state, [chunk], bucket=BUCKET)
    out = {1: [int(np.asarray(pre.tokens)[0])]}
    host.state = eng.insert(pre, host.state, [1])
    host.drain(out)
    assert out[1] == expected


# --------------------------------------------------------------------------- recompute


@SETTINGS
@example(cut=1, seed=0)
@given(cut=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_a_recomputed_request_continues_the_same_token_stream(cut, seed):
    """A request preempted after ``cut`` tokens is recomputed from its prompt plus those
    tokens (in two chunks, into fresh pages) with ``generated = cut``: it samples the
    rest of the stream it would have sampled, seeded or greedy."""
    eng = main_engine()
    prompt = np.random.default_rng(seed).integers(0, VOCAB, 11).tolist()
    for sampling in (sampled(seed, 10), greedy(10)):
        full = generate(eng, [req(prompt, sampling)])[0].token_ids
        tokens = prompt + full[:cut]
        host = Host(eng)
        got = host.pool.admit("again", tokens, reserve=10 - cut)
        assert got is not None
        half = len(tokens) // 2
        first = Chunk(tokens[:half], 0, got.pages, sampling, last=False)
        host.state, _ = eng.prefill(host.state, [first], bucket=BUCKET)
        rest = Chunk(tokens[half:], half, got.pages, sampling, generated=cut)
        host.state, pre = eng.prefill(host.state, [rest], bucket=BUCKET)
        out = {1: [int(np.asarray(pre.tokens)[0])]}
        host.state = eng.insert(pre, host.state, [1])
        host.drain(out)
        assert full[:cut] + out[1] == full


# ------------------------------------------------------------- done rows and freed pages


def test_a_done_row_never_writes_into_pages_now_held_by_another_request():
    """Slot 0 finishes and its pages go back to the pool; its table row is left as it was
    (stale: still naming those pages). Request C gets exactly those pages, in slot 2, and
    decodes beside slot 0's done row for many steps: C equals its offline generation,
    so the done row wrote nothing into C's pages."""
    eng = main_engine()
    a = req(list(range(1, 21)), greedy(2))  # done at position 21: page 1, offset 5
    b = req([7] * 5, greedy(30))  # keeps the loop running
    c = req(list(range(50, 78)), greedy(4))  # A's pages; its position 21 is in its prompt
    expected = [r.token_ids for r in generate(eng, [a, b, c])]
    host = Host(eng)
    out = {0: [host.start(0, a, bucket=BUCKET)], 1: [host.start(1, b, bucket=BUCKET)]}
    host.hold_all_but(0)  # A's 2 pages, B's 3 (5 + 30 tokens), nothing else free
    while not host.step(out)[0]:
        pass
    a_pages = host.pool.pages(0)
    host.pool.release(0)  # the table keeps naming A's pages in row 0
    out[2] = [host.start(2, c, bucket=BUCKET)]
    assert sorted(host.pool.pages(2)) == sorted(a_pages) and host.pool.free == 0
    host.drain(out)
    assert [out[0], out[1], out[2]] == expected


# ------------------------------------------------------------- staged or read per step


def refilled_mid_flight(
    eng: Engine, free_pages: int | None = None
) -> tuple[dict[int, list[int]], list[int]]:
    """Three requests (greedy and seeded, ragged) through a host loop of decode chunks; the
    third, finished first, is replaced mid-flight by a fourth in its slot (its freed pages
    reused). ``free_pages``: hold all of the pool but these. Returns the tokens of the
    slots at the end and those of the finished request."""
    reqs = [req([3, 1, 4], greedy(9)), req([2] * 20, sampled(5, 7)), req([8], greedy(3))]
    host = Host(eng)
    if free_pages is not None:
        host.hold_all_but(free_pages)
    out = {s: [host.start(s, r, bucket=BUCKET)] for s, r in enumerate(reqs)}
    while not host.step(out)[2]:
        pass
    host.finish(2)
    finished = out.pop(2)
    out[2] = [host.start(2, req([5, 6, 7, 8], sampled(9, 6)), bucket=BUCKET)]
    host.drain(out)
    return out, finished


@functools.cache
def unstaged_engine() -> Engine:
    """main_engine's model with every decode step reading the pages (the accelerators'
    form) instead of a staged contiguous copy (XLA:CPU's)."""
    eng = make_engine(main_engine().cfg)
    eng.tuning = dataclasses.replace(eng.tuning, staged_pages=False)
    return eng


def test_staged_decoding_equals_reading_the_pages_every_step():
    """The same three requests (greedy and seeded, ragged) through a host loop of decode
    chunks, once staged and once reading the pages every step, with a slot refilled
    mid-flight (its freed pages reused): the same tokens."""
    outs = []
    for eng in (main_engine(), unstaged_engine()):
        assert eng.tuning.staged_pages == (eng is main_engine())
        outs.append(refilled_mid_flight(eng, free_pages=6))
    assert outs[0] == outs[1]


def test_a_call_stages_the_span_of_the_table_and_decodes_as_the_pages_do():
    """Requests admitted one by one, each reaching a longer staged length of main_engine
    (64, 128, 192 of its 256 tokens), decode the same tokens staged, each call as long as
    its table's span, as read from the pages every step. The span grows with each insert
    (no ``set_table`` between the insert and the next chunk) and shrinks with the table
    once the long request is gone."""
    eng = main_engine()
    assert eng.stage_lengths == (64, 128, 192, 256) and unstaged_engine().stage_lengths == (256,)
    reqs = [
        req([2, 9], greedy(40)),
        req(list(range(1, 61)), sampled(4, 12)),
        req([7] * 120, greedy(9)),
    ]
    outs, spans = [], []
    for engine in (eng, unstaged_engine()):
        host = Host(engine)
        seen = [host.state.span]
        out: dict[int, list[int]] = {}
        for slot, r in enumerate(reqs):
            out[slot] = [host.start(slot, r)]
            seen.append(host.state.span)
            host.step(out)
        host.drain(out)
        host.finish(2)
        seen.append(host.state.span)
        outs.append(out)
        spans.append(seen)
    assert outs[0] == outs[1]
    # Pages for a request's prompt and budget: 2 + 40, 60 + 12 and 120 + 9 tokens.
    assert spans[0] == [64, 64, 128, 192, 128]
    assert spans[1] == [256] * 5


# ------------------------------------------------------------- steps per loop trip


@functools.cache
def unroll_engine() -> Engine:
    """main_engine's model in an engine of its own: the tests below change its
    ``inference.decode_unroll`` and its tuning's staging between runs."""
    return make_engine(main_engine().cfg)


def set_unroll(eng: Engine, unroll: int | None, *, staged: bool) -> None:
    inf = eng.cfg.inference.model_copy(update={"decode_unroll": unroll})
    eng.cfg = eng.cfg.model_copy(update={"inference": inf})
    eng.tuning = dataclasses.replace(eng.tuning, staged_pages=staged)


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pages"])
def test_an_unrolled_decode_loop_gives_the_tokens_of_one_step_per_trip(staged):
    """Two and three steps per trip of the decode loop (chunks of 4: a trip of three
    ends past the chunk, so its last steps must do nothing) give the tokens of one: greedy
    and seeded rows that finish inside a trip, and a slot refilled mid-flight."""
    eng = unroll_engine()
    outs = []
    for unroll in (1, 2, 3):
        set_unroll(eng, unroll, staged=staged)
        assert eng.decode_unroll(3) == unroll and eng.staged == staged
        outs.append(refilled_mid_flight(eng))
    assert outs[0] == outs[1] == outs[2]
    assert [len(t) for t in outs[0][0].values()] == [9, 7, 6] and len(outs[0][1]) == 3


def test_the_platform_unrolls_small_batches_unless_the_config_says():
    """Unset, a state of up to ``Tuning.unroll_decode_rows`` slots decodes two steps per
    trip (a TPU's 8; none on the CPU), a larger one one; ``inference.decode_unroll`` wins."""
    assert tuning.tuning_for("tpu").unroll_decode_rows == 8
    assert tuning.tuning_for("cpu").unroll_decode_rows == 0
    assert tuning.tuning_for("gpu").unroll_decode_rows == 0
    eng = unroll_engine()
    try:
        set_unroll(eng, None, staged=True)
        assert [eng.decode_unroll(n) for n in (1, 64)] == [1, 1]  # the CPU's tuning
        eng.tuning = dataclasses.replace(eng.tuning, unroll_decode_rows=8)
        assert [eng.decode_unroll(n) for n in (1, 8, 9, 32)] == [2, 2, 1, 1]
        set_unroll(eng, 3, staged=True)
        assert [eng.decode_unroll(n) for n in (1, 32)] == [3, 3]
    finally:
        eng.tuning = dataclasses.replace(eng.tuning, unroll_decode_rows=0)


# --------------------------------------------------------------------- the pool, the table


def test_pool_size_from_the_config_and_the_table_on_the_device():
    eng = main_engine()
    assert eng.page_size == 16 and eng.max_pages == 16
    assert eng.pool_pages(4) == 4 * 16  # default: every slot can hold max_len tokens
    state = eng.init_decode_state(2)
    assert state.cache.num_pages == 2 * 16 and state.table.shape == (2, 16)
    assert (np.asarray(state.table) == 32).all()  # NO_PAGE everywhere
    assert np.asarray(state.done).all()

    by_count = eng.cfg.model_copy(deep=True)
    by_count.inference = InferenceConfig(max_len=256, num_pages=40)
    by_budget = eng.cfg.model_copy(deep=True)
    by_budget.inference = InferenceConfig(max_len=256, kv_cache_mib=1.0)
    for cfg, pages in ((by_count, 40), (by_budget, 2**20 // eng.page_bytes)):
        other = Engine(eng.graphdef, eng.params, cfg)
        assert other.pool_pages(4) == pages
        assert other.pool_pages(4, groups=2) == (
            pages // 2 if cfg is by_count else 2**19 // eng.page_bytes
        )
    # K and V, 2 layers, 16 tokens, 2 kv heads of 8 lanes, float32.
    assert eng.page_bytes == 2 * 2 * 16 * 2 * 8 * 4

    compiles = dict(eng.compiles)
    table = np.arange(32, dtype=np.int32).reshape(2, 16)[::-1]
    state = eng.set_table(state, table)
    np.testing.assert_array_equal(np.asarray(state.table), table)
    assert eng.compiles == compiles  # a host-to-device copy, no compile
    with pytest.raises(ValueError, match="shape"):
        eng.set_table(state, table[:1])
    with pytest.raises(ValueError, match="NO_PAGE = 32"):
        eng.set_table(state, table + 2)


def test_chunks_that_do_not_fit_are_refused():
    eng = main_engine()
    state = eng.init_decode_state(1, 4)
    sp = greedy(1)
    bad = {
        "empty": Chunk([], 0, [0], sp),
        "pages for 20 tokens": Chunk([1] * 20, 0, [0], sp),
        "outside the pool": Chunk([1] * 3, 0, [4], sp),
        "max_len": Chunk([1] * 8, 250, list(range(16)), sp),
    }
    for why, chunk in bad.items():
        with pytest.raises(ValueError, match=why.split()[-1]):
            eng.prefill(state, [chunk])


# --------------------------------------------------------------------------- compiles


@functools.cache
def sweep_engine() -> Engine:
    """One layer and the reference kernels: the cheapest programs to compile."""
    return make_engine(tiny_cfg(2, 64, [8, 32, 64], 1, page_size=8, attention_impl="reference"))


def test_a_sweep_of_chunk_shapes_compiles_at_most_the_bucket_product():
    """Chunk lengths 1..30 (length buckets 8 and 32), starts at 0 or anywhere after (the
    two kinds of prefill), three or four chunks per call (row bucket 4): prefill compiles
    once per (length bucket, row bucket, kind) it meets, never per length, start or row
    count; ``insert`` once per prefix size; ``set_table`` never."""
    eng = sweep_engine()
    rng = np.random.default_rng(0)
    seen: set[tuple[int | None, int, bool]] = set()
    state = eng.init_decode_state(4, 4 * eng.max_pages)
    for _ in range(16):
        n_rows = int(rng.integers(3, 5))
        from_start = bool(rng.integers(0, 2))
        short = bool(rng.integers(0, 2))
        chunks = []
        for r in range(n_rows):
            n = int(rng.integers(1, 9) if short else rng.integers(9, 31))
            start = 0 if from_start else int(rng.integers(1, 64 - n))
            pages = list(range(r * eng.max_pages, (r + 1) * eng.max_pages))
            chunks.append(Chunk(rng.integers(0, VOCAB, n).tolist(), start, pages, greedy(1)))
        state, pre = eng.prefill(state, chunks)
        seen.add((pre.bucket, row_bucket(n_rows), from_start))
        state = eng.insert(pre, state, list(range(n_rows)))
        state = eng.set_table(state, np.asarray(state.table))
    assert {b for b, _, _ in seen} == {8, 32} and {r for _, r, _ in seen} == {4}
    assert eng.compiles["prefill"] == len(seen) <= 2 * 1 * 2
    assert eng.compiles["insert"] == 1 and "generate" not in eng.compiles


def test_every_prefill_row_count_pads_to_a_power_of_two():
    assert [row_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
