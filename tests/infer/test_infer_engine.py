"""The engine: cached == full-prefix decode, ragged batches, buckets, compiles, slots.

The engines come from ``tiny_engines`` (cached per process, fixed shapes): hypothesis
examples vary prompt contents, lengths, budgets and model weights without recompiling.
The paged cache's own properties (chunks, prefixes, recompute, freed pages) are in
``test_paged_engine.py``.
"""

from __future__ import annotations

import functools

import jax
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
    numpy_params,
    prefilled,
    req,
    tiny_cfg,
    variant_engine,
)

from jaxlab.infer import (
    Chunk,
    Engine,
    Request,
    RequestTooLong,
    SamplingParams,
    decode_step,
    generate,
    measure,
    naive_step,
    stream,
)
from jaxlab.kernels import PAGED_KERNELS
from jaxlab.kernels.rows import row_buckets

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


@functools.cache
def lockstep(n_kv_heads: int):
    """One executable stepping the cached and the cache-free state together."""
    eng = variant_engine(n_kv_heads)

    def both(weights, cached, full):
        return (
            decode_step(eng.graphdef, weights, cached, buckets=eng.tuning.row_buckets),
            naive_step(eng.graphdef, weights.params, full),
        )

    return jax.jit(both)


def prompts_of(n_rows: int, max_size: int = 14):
    return st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size),
        min_size=n_rows,
        max_size=n_rows,
    )


# ---------------------------------------------------------------- cached == full prefix


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@SETTINGS
@given(prompts=prompts_of(3), seed=st.integers(0, 2**16))
def test_cached_decode_equals_full_prefix_decode(n_kv_heads, prompts, seed):
    """Random weights and ragged prompts: the same logits at every decode step (within
    float tolerance) and the same greedy tokens, including prefill's first token."""
    eng = variant_engine(n_kv_heads)
    params = numpy_params(eng.cfg, seed)[1]
    weights = eng.weights(params)  # the tied variant's head: a transposed copy, as served
    step = lockstep(n_kv_heads)
    sp = [greedy(9)] * len(prompts)
    state, first, _ = prefilled(eng, prompts, sp, params=params, bucket=16, seed=seed)
    naive = eng.naive().initial_state(prompts, sp)
    # The cached state is one token ahead (prefill sampled t = 0), so the naive step i is
    # compared with the cached step i - 1, and naive step 0 with prefill's token.
    ahead_logits, ahead_tokens = None, first
    for i in range(7):
        (state, lc, ec), (naive, ln, en) = step(weights, state, naive)
        if ahead_logits is not None:
            np.testing.assert_allclose(ahead_logits, np.asarray(ln), atol=3e-5, rtol=1e-5)
        np.testing.assert_array_equal(ahead_tokens, np.asarray(en), err_msg=f"step {i}")
        ahead_logits, ahead_tokens = np.asarray(lc), np.asarray(ec)


# ------------------------------------------------------------------- weights for decoding


def test_a_tied_head_is_transposed_once_for_decoding_on_the_cpu():
    """Tied: a ``[d_model, vocab]`` copy of the embedding table (XLA:CPU's tuning), rebuilt
    when ``params`` change. Untied: no copy, the ``lm_head`` parameter itself is read."""
    tied = variant_engine(1)
    assert tied.cfg.model.tie_embeddings and tied.tuning.transposed_head
    table = np.asarray(tied.params["embed"]["table"][...])
    head = tied.weights().head
    assert head is not None and head.shape == (tied.cfg.model.d_model, VOCAB)
    np.testing.assert_array_equal(np.asarray(head), table.T)
    assert tied.weights() is tied.weights()  # prepared once, not per call

    params = numpy_params(tied.cfg, 7)[1]
    fresh = np.asarray(params["embed"]["table"][...])
    np.testing.assert_array_equal(np.asarray(tied.weights(params).head), fresh.T)
    before = tied.params
    try:
        tied.params = params
        np.testing.assert_array_equal(np.asarray(tied.weights().head), fresh.T)
    finally:
        tied.params = before
    np.testing.assert_array_equal(np.asarray(tied.weights().head), table.T)

    untied = main_engine()
    assert not untied.cfg.model.tie_embeddings
    assert untied.weights().head is None


def test_step_weight_bytes_count_what_a_decode_step_reads():
    """Every parameter but the lookup tables (token, learned positions), plus the head
    kernel: for a tied model that is the transposed copy, for an untied one ``lm_head``."""

    def nbytes(tree) -> int:
        return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    for engine in (variant_engine(1), main_engine()):
        m = engine.cfg.model
        tables = nbytes(engine.params["embed"])
        if "pos_embed" in engine.params:
            tables += nbytes(engine.params["pos_embed"])
        head = m.vocab_size * m.d_model * 4  # f32
        expected = nbytes(engine.params) - tables + (head if m.tie_embeddings else 0)
        assert engine.step_weight_bytes == expected
    assert "pos_embed" in variant_engine(1).params  # the learned-positions case was covered


# ------------------------------------------------------------ ragged batches, buckets


@SETTINGS
@given(prompts=prompts_of(3), budgets=st.lists(st.integers(1, 12), min_size=3, max_size=3))
def test_ragged_batch_equals_each_prompt_alone(prompts, budgets):
    """Different lengths and budgets in one batch; each row equals its solo generation."""
    eng = main_engine()
    reqs = [req(p, greedy(n)) for p, n in zip(prompts, budgets, strict=True)]
    batch = generate(eng, reqs)
    assert batch.bucket == (16 if max(map(len, prompts)) > 8 else 8)
    for r, res in zip(reqs, batch, strict=True):
        assert res.token_ids == generate(eng, [r])[0].token_ids
        assert res.generated_tokens == r.sampling.max_new_tokens
        assert res.finish_reason == "length"


@SETTINGS
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
def test_bucketing_never_changes_outputs(prompt):
    """The same prompt padded to 8 and to 64 slots: identical tokens."""
    eng = main_engine()
    outs = []
    for bucket in (8, 64):
        state, first, _ = prefilled(eng, [prompt], [greedy(10)], bucket=bucket)
        _, toks, done = eng.generate(state, eng.max_len)  # offline generate's executable
        assert bool(done[0])
        outs.append([int(first[0])] + [int(t) for t in np.asarray(toks)[:, 0] if t >= 0])
    assert outs[0] == outs[1] and len(outs[0]) == 10


# ------------------------------------------------------------------------- compiles


def test_generate_compiles_once_and_prefill_once_per_bucket():
    """Batch-1 decoding: one executable per staged length (the table's span), whatever the
    steps and positions, so a second request of the same span compiles nothing; prefill:
    at most one per bucket across many prompt lengths (signatures hold the shapes), and
    its first token (head and sampling) once per row count, whatever the lengths."""
    eng = main_engine()
    gen = generate(eng, [req([1, 2, 3], greedy(200))])
    assert gen[0].generated_tokens == 200
    compiled = eng.compiles["generate"]
    generate(eng, [req([5, 4], greedy(199))])  # other tokens and steps, the same span (256)
    assert eng.compiles["generate"] == compiled
    before, heads = eng.compiles["prefill"], eng.compiles["first_token"]
    used = {generate(eng, [req(list(range(n)), greedy(2))]).bucket for n in range(1, 40, 2)}
    assert used == {8, 16, 32, 64}
    assert eng.compiles["prefill"] - before <= len(used) - 1  # bucket 8 ran already
    assert eng.compiles["first_token"] == heads  # one row every time: compiled already

    # (k = max_len, 1 slot): one executable per staged length, whatever the steps and lengths
    batch1 = [t for t in eng.compile_log if t.name == "generate" and "bool[1]" in t.signature]
    assert 1 <= len(batch1) <= len(eng.stage_lengths) == 4
    assert gen.compiles["generate"] >= 1  # the counts travel with the results


def test_requests_that_cannot_fit_get_a_clear_error():
    eng = main_engine()
    with pytest.raises(RequestTooLong, match=r"inference\.max_len = 256") as e:
        req(list(range(200)), greedy(57))
    assert "200 tokens" in str(e.value) and "57" in str(e.value) and "257" in str(e.value)
    assert e.value.param == "prompt"
    req(list(range(200)), greedy(56), eng)  # exactly full is fine


# ---------------------------------------------------------------- the device API verbs


def test_prefill_insert_generate_equals_offline_generate():
    """JetStream-style slots: prefill one request at a time, insert, decode in chunks;
    a finished slot is refilled mid-flight, its pages lent to the next request. Every
    request matches offline generation."""
    eng = main_engine()
    reqs = [
        req([3, 1, 4, 1, 5], greedy(6)),
        req([2, 7, 1, 8, 2, 8, 1, 8, 2, 8], greedy(20)),
        req([9], SamplingParams(max_new_tokens=9, temperature=0.9, top_k=40, seed=7)),
        req([6, 6, 6], greedy(5)),  # waits for a free slot
    ]
    expected = [generate(eng, [r])[0].token_ids for r in reqs]

    host = Host(eng)
    host.hold_all_but(3 * 2)  # 2 pages of 16 tokens per slot: every page is reused
    got: dict[int, list[int]] = {}
    slot_of: dict[int, int] = {}
    waiting = list(range(len(reqs)))
    free = [0, 1, 2]
    inserts = eng.compiles["insert"]
    while waiting or slot_of:
        while waiting and free:
            i, slot = waiting.pop(0), free.pop(0)
            got[i] = [host.start(slot, reqs[i])]
            slot_of[i] = slot
        new: dict[int, list[int]] = {slot: [] for slot in range(3)}
        done = host.step(new)
        for i, slot in list(slot_of.items()):
            got[i] += new[slot]
            if done[slot]:
                del slot_of[i]
                host.finish(slot)
                free.append(slot)
    assert [got[i] for i in range(len(reqs))] == expected
    assert eng.compiles["insert"] - inserts <= 1  # one-row prefix into 3 slots: one shape


def slot_request(slot: int) -> Request:
    prompt = [(slot * 7 + j) % VOCAB for j in range(1 + slot % 5)]
    if slot % 3 == 2:
        return req(prompt, SamplingParams(max_new_tokens=5, temperature=0.9, seed=slot))
    return req(prompt, greedy(3 + slot % 4))


@functools.cache
def slots_engine() -> Engine:
    """Its own engine: the 16-slot state compiles insert and generate shapes of its own."""
    return make_engine(tiny_cfg(2, 256, [8, 256]))


@functools.cache
def solo_tokens(slot: int) -> list[int]:
    return generate(slots_engine(), [slot_request(slot)])[0].token_ids


@SETTINGS
@example(active={0})
@example(active={1})  # the 4-row bucket's first row
@example(active={3, 4})  # 4-row bucket edge, then the 16-row bucket's
@example(active={15})
@given(active=st.sets(st.integers(0, 15), min_size=1, max_size=16))
def test_idle_slots_past_the_last_active_row_are_skipped_exactly(active):
    """16 slots, any set of occupied ones: on the CPU the step computes only the leading
    rows up to the last occupied slot (a 1-, 4- or 16-row branch); every request still
    equals its offline generation, and the cache of every slot past the computed rows
    (finished requests here) is unchanged."""
    eng = slots_engine()
    assert eng.tuning.row_buckets and row_buckets(16) == (1, 4, 16)
    computed = next(r for r in row_buckets(16) if r > max(active))
    host = Host(eng, 16)
    got: dict[int, list[int]] = {}
    for slot in range(16):
        r = slot_request(slot)
        if slot not in active:  # a finished request: done, with filled pages
            r = req(list(r.prompt_ids), greedy(1))
        got[slot] = [host.start(slot, r)]
    kernel = PAGED_KERNELS[eng.paged_kernel]

    def tail(state) -> list[np.ndarray]:
        cache = state.cache
        return [
            np.asarray(a[computed:])
            for i in range(len(cache.pools))
            for a in kernel.to_bskd(cache.layer(i))
        ]

    state = host.state
    before = tail(state)
    while not bool(np.all(np.asarray(state.done))):
        state, toks, _ = eng.generate(state, 4)
        for slot in active:
            got[slot] += [int(t) for t in np.asarray(toks)[:, slot] if t >= 0]
    for a, b in zip(before, tail(state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert {s: got[s] for s in active} == {s: solo_tokens(s) for s in active}


def test_batched_prefill_and_insert_equal_offline_generate():
    """Several requests prefilled as one ragged batch and scattered into chosen slots
    (one row skipped with -1) decode exactly as each request alone."""
    eng = main_engine()
    prompts = [[5, 3, 2], [1] * 20, [8, 9]]  # the last is left out of the state (slot -1)
    samplings = [
        greedy(7),
        SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=3),
        greedy(4),
    ]
    expected = [
        generate(eng, [req(p, s)])[0].token_ids for p, s in zip(prompts, samplings, strict=True)
    ]
    host = Host(eng)
    pages = [
        host.pool.admit(i, p, reserve=s.max_new_tokens)
        for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
    ]
    chunks = [
        Chunk(p, 0, a.pages, s) for p, a, s in zip(prompts, pages, samplings, strict=True) if a
    ]
    state, pre = eng.prefill(host.state, chunks)
    first = np.asarray(pre.tokens)
    assert first.shape == (4,)  # three chunks, padded to a row bucket of four
    slots = [2, 0, -1]
    host.state = eng.insert(pre, state, slots)
    got = {0: [int(first[1])], 2: [int(first[0])]}
    host.drain(got)
    assert [got[0], got[2]] == expected[1::-1]
    assert bool(np.asarray(host.state.done)[1])  # untouched
    assert int(first[2]) == expected[2][0]  # the skipped row was still prefilled right
    with pytest.raises(ValueError, match="distinct"):
        eng.insert(pre, eng.init_decode_state(3), [1, 1, -1])
    with pytest.raises(ValueError, match="3 chunks"):
        eng.insert(pre, eng.init_decode_state(3), [0, 1])
    with pytest.raises(IndexError, match="out of range"):
        eng.insert(pre, eng.init_decode_state(3), [0, 3, -1])


def test_stream_chunks_concatenate_to_the_offline_result():
    eng = main_engine()
    reqs = [req([1, 2, 3], greedy(13)), req([4] * 9, greedy(5)), req([7], greedy(1))]
    s = stream(eng, reqs, chunk_tokens=4)
    pieces = list(s)
    assert len(pieces) == 1 + 3  # prefill, then ceil(12 / 4) chunks
    joined = [[t for p in pieces for t in p[i]] for i in range(3)]
    assert joined == [r.token_ids for r in generate(eng, reqs)]
    assert s.generation is not None and s.generation.ttft_s > 0


def test_the_cache_free_baseline_runs_through_the_same_offline_code():
    eng = variant_engine(1)
    reqs = [req([1, 2, 3], greedy(6), eng), req([4] * 9, greedy(4), eng)]
    cached, naive = generate(eng, reqs), generate(eng, reqs, kv_cache=False)
    assert [r.token_ids for r in naive] == [r.token_ids for r in cached]
    assert naive.bucket is None and not naive.kv_cache
    assert eng.compiles["naive_prefill"] == 1 and eng.compiles["naive_generate"] >= 1
    assert eng.compiles["naive_insert"] == 1


def test_eos_and_stop_tokens_end_a_row_and_are_not_returned():
    eng = main_engine()
    free_run = generate(eng, [req([5, 5, 5], greedy(12))])[0].token_ids
    stop = free_run[4]
    cut = free_run.index(stop)
    res = generate(
        eng, [req([5, 5, 5], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))]
    )[0]
    assert res.token_ids == free_run[:cut]
    assert res.finish_reason == "stop"
    # The tokenizer's EOS (Limits.eos_id) is one more stop token, folded in once.
    with_eos = Request.create([5, 5, 5], SamplingParams(max_new_tokens=12), eng.limits(stop))
    assert with_eos.stop_ids == {stop}
    assert generate(eng, [with_eos])[0].token_ids == free_run[:cut]


# -------------------------------------------------------------------------- sampling


def sampled(seed: int, **kw: object) -> SamplingParams:
    base: dict[str, object] = {"max_new_tokens": 12, "temperature": 1.0, "seed": seed}
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def test_same_seed_same_sample_different_seeds_differ():
    eng = main_engine()
    prompt = [10, 20, 30]
    a = generate(eng, [req(prompt, sampled(1))])[0].token_ids
    b = generate(eng, [req(prompt, sampled(1))])[0].token_ids
    assert a == b
    others = [generate(eng, [req(prompt, sampled(s))])[0].token_ids for s in range(2, 6)]
    assert all(o != a for o in others)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 2),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
)
def test_a_request_samples_the_same_alone_and_in_a_mixed_batch(seed, prompt):
    eng = main_engine()
    mine = req(prompt, sampled(seed, top_k=50, top_p=0.9, temperature=0.8))
    alone = generate(eng, [mine])[0].token_ids
    mixed = generate(
        eng,
        [
            req([1, 2, 3, 4, 5, 6, 7, 8, 9], greedy(4)),
            mine,
            req([42], sampled(seed + 1, temperature=1.5)),
        ],
    )
    assert mixed[1].token_ids == alone


def test_measure_generate_runs_before_and_warm_each_untimed(monkeypatch):
    """The peer suite runs the peer's repetition in ``before`` (once per call, warm-up
    included) and one of ours right after it (``warm_each``), neither inside a sample."""
    eng = variant_engine(1)
    calls: list[int] = []
    seen: list[None] = []
    real = measure.offline.generate

    def counting(*a, **k):
        calls.append(len(seen))
        return real(*a, **k)

    monkeypatch.setattr(measure.offline, "generate", counting)
    r = measure.measure_generate(
        eng, 1, 4, 3, repeats=3, warmup=2, before=lambda: seen.append(None), warm_each=1
    )
    # two warm-up calls, then per repetition: before, one untimed call, the timed call
    assert calls == [1, 2, 3, 3, 4, 4, 5, 5], "each call follows its own before()"
    assert len(r["wall_s"]) == 3 and all(v == 0 for v in r["recompiles_while_timed"].values())
