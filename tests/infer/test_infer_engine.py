"""The engine: cached == full-prefix decode, ragged batches, buckets, compiles, serving flow.

Compiles dominate the cost of these tests, so every test draws on a few engines cached at
module level with fixed shapes (batch, bucket, max_len): hypothesis examples vary prompt
contents, lengths, budgets and model weights without recompiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxlab.config import DataConfig, InferenceConfig, JaxlabConfig, ModelConfig, TokenizerConfig
from jaxlab.infer import (
    Engine,
    Request,
    RequestTooLong,
    SamplingParams,
    decode_step,
    naive_step,
)
from jaxlab.infer.core import prefill_forward
from jaxlab.infer.state import to_model_cache
from jaxlab.model import apply, init_kv_cache, make_model, split_model

VOCAB = 258
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


def tiny_cfg(
    n_kv_heads: int, max_len: int, buckets: list[int], n_layers: int = 2, **model: object
) -> JaxlabConfig:
    return JaxlabConfig(
        model=ModelConfig(
            vocab_size=VOCAB,
            n_layers=n_layers,
            d_model=32,
            n_heads=4,
            n_kv_heads=n_kv_heads,
            d_mlp=64,
            max_seq_len=max_len,
            **model,  # type: ignore[arg-type]
        ),
        tokenizer=TokenizerConfig(kind="byte"),
        data=DataConfig(seq_len=min(64, max_len)),
        inference=InferenceConfig(max_len=max_len, prefill_buckets=buckets),
    )


def numpy_params(cfg: JaxlabConfig, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
    """A random model without a single compile: eager init would compile every op shape."""
    graphdef, abstract = split_model(
        nnx.eval_shape(lambda: make_model(cfg.model, cfg.train.precision, 0))
    )
    rng = np.random.default_rng(seed)

    def leaf(path: tuple, a: jax.ShapeDtypeStruct) -> jax.Array:
        if "scale" in jax.tree_util.keystr(path):  # RMSNorm gains near 1
            x = 1.0 + 0.1 * rng.standard_normal(a.shape)
        else:
            x = 0.08 * rng.standard_normal(a.shape)
        return jax.device_put(x.astype(a.dtype))

    return graphdef, jax.tree_util.tree_map_with_path(leaf, abstract)


def make_engine(cfg: JaxlabConfig, seed: int = 0) -> Engine:
    graphdef, params = numpy_params(cfg, seed)
    return Engine(graphdef, params, cfg)


@functools.cache
def main_engine() -> Engine:
    """GQA (2 kv heads for 4 query heads), 2 layers; the engine most tests share."""
    return make_engine(tiny_cfg(2, 256, [8, 16, 32, 64, 256]))


@functools.cache
def variant_engine(n_kv_heads: int) -> Engine:
    if n_kv_heads == 2:
        return main_engine()
    if n_kv_heads == 1:  # MQA, GPT-2-like variant: learned positions, tied head, GELU
        cfg = tiny_cfg(1, 32, [16, 32], 1, positions="learned", tie_embeddings=True, mlp="gelu")
    else:  # MHA
        cfg = tiny_cfg(n_kv_heads, 32, [16, 32], 1)
    return make_engine(cfg)


@functools.cache
def lockstep(n_kv_heads: int):
    """One executable stepping the cached and the cache-free state together."""
    eng = variant_engine(n_kv_heads)

    def both(weights, cached, full):
        return (
            decode_step(eng.graphdef, weights, cached),
            naive_step(eng.graphdef, weights.params, full),
        )

    return jax.jit(both)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


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
    state, _ = eng.prefill_batch(prompts, sp, params=params, bucket=16)
    naive = eng._naive_state(prompts, sp)
    # The cached state is one token ahead (prefill sampled t = 0), so the naive step i is
    # compared with the cached step i - 1, and naive step 0 with prefill's token.
    ahead_logits, ahead_tokens = None, np.asarray(state.tokens)
    for i in range(7):
        (state, lc, ec), (naive, ln, en) = step(weights, state, naive)
        if ahead_logits is not None:
            np.testing.assert_allclose(ahead_logits, np.asarray(ln), atol=3e-5, rtol=1e-5)
        np.testing.assert_array_equal(ahead_tokens, np.asarray(en), err_msg=f"step {i}")
        ahead_logits, ahead_tokens = np.asarray(lc), np.asarray(ec)


def test_prefill_and_decode_step_equal_the_models_cached_forward():
    """Prefill (head only at the last positions, a bucket-length cache) and the fused decode
    step == ``model.apply`` with the model's own KV cache layout."""
    eng = main_engine()
    prompts = [[5, 6, 7], [9] * 11, [1, 2]]
    tokens = np.zeros((3, 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts])

    def both(weights, tokens, lengths):
        params = weights.params
        cache = init_kv_cache(eng.cfg.model, 3, eng.max_len)
        pos = jnp.broadcast_to(jnp.arange(16), (3, 16))
        full, ref = apply(eng.graphdef, params, tokens, pos, kv_cache=cache, cache_index=pos[:, 0])
        model = nnx.merge(eng.graphdef, params)
        last, got = prefill_forward(model, weights.head, tokens, lengths, cache)
        return jnp.take_along_axis(full, (lengths - 1)[:, None, None], 1)[:, 0], ref, last, got

    want, ref, last, got = jax.jit(both)(eng.weights(), jnp.asarray(tokens), lengths)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want), atol=2e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The engine's prefill runs over a cache of the bucket's 16 slots, not max_len: the
    # same cache (zeros past the bucket) and the same first tokens as the model's forward
    # over every slot.
    state, _ = eng.prefill_batch(prompts, [greedy(4)] * 3, bucket=16)
    assert eng.max_len > 16
    for a, b in zip(jax.tree.leaves(to_model_cache(state)), jax.tree.leaves(ref), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.tokens), np.argmax(np.asarray(want), -1))
    ref_logits, ref_cache = jax.jit(
        lambda p, c, t, q: apply(eng.graphdef, p, t[:, None], q[:, None], kv_cache=c, cache_index=q)
    )(eng.params, to_model_cache(state), state.tokens, state.pos)
    naive = eng._naive_state(prompts, [greedy(4)] * 3)
    (new, logits, _), _ = lockstep(2)(eng.weights(), state, naive)  # reuse its executable
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits[:, 0]), atol=2e-5)
    assert ref_cache is not None
    for a, b in zip(jax.tree.leaves(to_model_cache(new)), jax.tree.leaves(ref_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_weights_hold_the_lm_head_as_a_d_model_by_vocab_kernel():
    """Tied: a transposed copy of the embedding table, rebuilt when ``params`` change.
    Untied: the ``lm_head`` parameter itself, no copy."""
    tied = variant_engine(1)
    assert tied.cfg.model.tie_embeddings
    table = np.asarray(tied.params["embed"]["table"][...])
    head = tied.weights().head
    assert head.shape == (tied.cfg.model.d_model, VOCAB)
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
    assert untied.weights().head is untied.params["lm_head"][...]


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
        head = m.vocab_size * m.d_model * engine.weights().head.dtype.itemsize
        expected = nbytes(engine.params) - tables + (head if m.tie_embeddings else 0)
        assert engine.step_weight_bytes == expected
    assert "pos_embed" in variant_engine(1).params  # the learned-positions case was covered


# ------------------------------------------------------------ ragged batches, buckets


@SETTINGS
@given(prompts=prompts_of(3), budgets=st.lists(st.integers(1, 12), min_size=3, max_size=3))
def test_ragged_batch_equals_each_prompt_alone(prompts, budgets):
    """Different lengths and budgets in one batch; each row equals its solo generation."""
    eng = main_engine()
    reqs = [Request(p, greedy(n)) for p, n in zip(prompts, budgets, strict=True)]
    batch = eng.generate(reqs)
    assert batch.bucket == (16 if max(map(len, prompts)) > 8 else 8)
    for req, res in zip(reqs, batch, strict=True):
        assert res.token_ids == eng.generate([req])[0].token_ids
        assert res.generated_tokens == req.sampling.max_new_tokens
        assert res.finish_reason == "length"


@SETTINGS
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
def test_bucketing_never_changes_outputs(prompt):
    """The same prompt padded to 8 and to 64 slots: identical tokens."""
    eng = main_engine()
    outs = []
    for bucket in (8, 64):
        state, _ = eng.prefill_batch([prompt], [greedy(10)], bucket=bucket)
        first = int(state.tokens[0])
        state, toks, done = eng.generate_chunk(state, eng.max_len)  # generate's executable
        assert bool(done[0])
        outs.append([first] + [int(t) for t in np.asarray(toks)[:, 0] if t >= 0])
    assert outs[0] == outs[1] and len(outs[0]) == 10


# ------------------------------------------------------------------------- compiles


def test_decode_compiles_once_and_prefill_once_per_bucket():
    """Batch-1 decode: one executable for 200 tokens (every step and position); prefill:
    at most one per bucket across many prompt lengths (signatures hold the shapes)."""
    eng = main_engine()
    gen = eng.generate([Request([1, 2, 3], greedy(200))])
    assert gen[0].generated_tokens == 200
    used = {eng.generate([Request(list(range(n)), greedy(2))]).bucket for n in range(1, 40, 2)}
    assert used == {8, 16, 32, 64}

    def batch1(name: str) -> list[str]:
        return [
            t.signature for t in eng.compile_log if t.name == name and "int32[1]" in t.signature
        ]

    assert len(batch1("decode")) == 1  # (k = max_len, 1 slot): all 200 steps, all lengths
    prefill = batch1("prefill")
    buckets = sorted(int(s.split("int32[1, ")[1].split("]")[0]) for s in prefill)
    assert buckets == sorted(set(buckets)) and set(used) <= set(buckets) <= set(eng.buckets)
    assert gen.compiles["decode"] >= 1  # the counts travel with the results


def test_requests_that_cannot_fit_get_a_clear_error():
    eng = main_engine()
    with pytest.raises(RequestTooLong, match=r"inference\.max_len = 256") as e:
        eng.generate([Request(list(range(200)), greedy(57))])
    assert "200 tokens" in str(e.value) and "57" in str(e.value) and "257" in str(e.value)
    eng.check_request(list(range(200)), greedy(56))  # exactly full is fine


# ---------------------------------------------------------------- serving building blocks


def test_prefill_insert_generate_chunk_equals_offline_generate():
    """JetStream-style slots: prefill one request at a time, insert, decode in chunks;
    a finished slot is refilled mid-flight. Every request matches offline generation."""
    eng = main_engine()
    reqs = [
        Request([3, 1, 4, 1, 5], greedy(6)),
        Request([2, 7, 1, 8, 2, 8, 1, 8, 2, 8], greedy(20)),
        Request([9], SamplingParams(max_new_tokens=9, temperature=0.9, top_k=40, seed=7)),
        Request([6, 6, 6], greedy(5)),  # waits for a free slot
    ]
    expected = [eng.generate([r])[0].token_ids for r in reqs]

    state = eng.init_decode_state(3)
    got: dict[int, list[int]] = {}
    slot_of: dict[int, int] = {}
    waiting = list(range(len(reqs)))
    free = [0, 1, 2]
    while waiting or slot_of:
        while waiting and free:
            i, slot = waiting.pop(0), free.pop(0)
            prefix = eng.prefill(reqs[i].prompt, reqs[i].sampling)
            got[i] = [int(prefix.tokens[0])]
            state = eng.insert(prefix, state, slot)
            slot_of[i] = slot
        state, toks, done = eng.generate_chunk(state, 4)
        toks, done = np.asarray(toks), np.asarray(done)
        for i, slot in list(slot_of.items()):
            got[i] += [int(t) for t in toks[:, slot] if t >= 0]
            if done[slot]:
                del slot_of[i]
                free.append(slot)
    assert [got[i] for i in range(len(reqs))] == expected
    assert eng.compiles["insert"] == 1


@pytest.mark.parametrize(
    ("slots", "buckets"),
    [(1, (1,)), (3, (1, 3)), (4, (1, 4)), (8, (1, 4, 8)), (16, (1, 4, 16)), (64, (1, 4, 16, 64))],
)
def test_row_buckets(slots, buckets):
    from jaxlab.infer.fused import row_buckets

    assert row_buckets(slots) == buckets


def slot_request(slot: int) -> Request:
    prompt = [(slot * 7 + j) % VOCAB for j in range(1 + slot % 5)]
    if slot % 3 == 2:
        return Request(prompt, SamplingParams(max_new_tokens=5, temperature=0.9, seed=slot))
    return Request(prompt, greedy(3 + slot % 4))


@functools.cache
def slots_engine() -> Engine:
    """Its own engine: the 16-slot state compiles insert and decode shapes of its own."""
    return make_engine(tiny_cfg(2, 256, [8, 256]))


@functools.cache
def solo_tokens(slot: int) -> list[int]:
    return slots_engine().generate([slot_request(slot)])[0].token_ids


@SETTINGS
@example(active={0})
@example(active={1})  # the 4-row bucket's first row
@example(active={3, 4})  # 4-row bucket edge, then the 16-row bucket's
@example(active={15})
@given(active=st.sets(st.integers(0, 15), min_size=1, max_size=16))
def test_idle_slots_past_the_last_active_row_are_skipped_exactly(active):
    """16 slots, any set of occupied ones: the step computes only the leading rows up to
    the last occupied slot (a 1-, 4- or 16-row branch); every request still equals its
    offline generation, and the cache of every slot past the computed rows (finished
    requests here) is unchanged."""
    from jaxlab.infer.fused import row_buckets

    eng = slots_engine()
    buckets = row_buckets(16)
    assert buckets == (1, 4, 16)
    computed = next(r for r in buckets if r > max(active))
    state = eng.init_decode_state(16)
    got: dict[int, list[int]] = {}
    for slot in range(16):
        req = slot_request(slot)
        if slot not in active:  # a finished request: done, with a filled cache row
            req = Request(req.prompt, greedy(1))
        prefix = eng.prefill(req.prompt, req.sampling)
        got[slot] = [int(prefix.tokens[0])]
        state = eng.insert(prefix, state, slot)
    kv = eng.cfg.model.n_kv_heads
    before = [np.asarray(b[computed * kv :]) for b in jax.tree.leaves((state.k, state.v))]
    while not bool(np.all(np.asarray(state.done))):
        state, toks, _ = eng.generate_chunk(state, 4)
        for slot in active:
            got[slot] += [int(t) for t in np.asarray(toks)[:, slot] if t >= 0]
    after = [np.asarray(b[computed * kv :]) for b in jax.tree.leaves((state.k, state.v))]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    assert {s: got[s] for s in active} == {s: solo_tokens(s) for s in active}


def test_batched_prefill_insert_rows_equals_offline_generate():
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
        eng.generate([Request(p, s)])[0].token_ids for p, s in zip(prompts, samplings, strict=True)
    ]
    state = eng.init_decode_state(4)
    prefix, _ = eng.prefill_batch(prompts, samplings)
    first = np.asarray(prefix.tokens)
    slots = [3, 0, -1]
    state = eng.insert_rows(prefix, state, slots)
    got = {0: [int(first[0])], 1: [int(first[1])]}
    while not bool(np.all(np.asarray(state.done))):
        state, toks, _ = eng.generate_chunk(state, 4)
        for i in (0, 1):
            got[i] += [int(t) for t in np.asarray(toks)[:, slots[i]] if t >= 0]
    assert [got[0], got[1]] == expected[:2]
    assert bool(np.asarray(state.done)[1]) and bool(np.asarray(state.done)[2])  # untouched
    assert int(first[2]) == expected[2][0]  # the skipped row was still prefilled right
    with pytest.raises(ValueError, match="distinct"):
        eng.insert_rows(prefix, eng.init_decode_state(4), [1, 1, -1])
    with pytest.raises(ValueError, match="3 rows"):
        eng.insert_rows(prefix, eng.init_decode_state(4), [0, 1])
    with pytest.raises(IndexError, match="out of range"):
        eng.insert_rows(prefix, eng.init_decode_state(4), [0, 4, -1])


def test_stream_chunks_concatenate_to_the_offline_result():
    eng = main_engine()
    reqs = [Request([1, 2, 3], greedy(13)), Request([4] * 9, greedy(5)), Request([7], greedy(1))]
    stream = eng.stream(reqs, chunk_tokens=4)
    pieces = list(stream)
    assert len(pieces) == 1 + 3  # prefill, then ceil(12 / 4) chunks
    joined = [[t for p in pieces for t in p[i]] for i in range(3)]
    assert joined == [r.token_ids for r in eng.generate(reqs)]
    assert stream.generation is not None and stream.generation.ttft_s > 0


def test_eos_and_stop_tokens_end_a_row_and_are_not_returned():
    eng = main_engine()
    free_run = eng.generate([Request([5, 5, 5], greedy(12))])[0].token_ids
    stop = free_run[4]
    cut = free_run.index(stop)
    res = eng.generate(
        [Request([5, 5, 5], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))]
    )[0]
    assert res.token_ids == free_run[:cut]
    assert res.finish_reason == "stop"


# -------------------------------------------------------------------------- sampling


def sampled(seed: int, **kw: object) -> SamplingParams:
    base: dict[str, object] = {"max_new_tokens": 12, "temperature": 1.0, "seed": seed}
    base.update(kw)
    return SamplingParams(**base)  # type: ignore[arg-type]


def test_same_seed_same_sample_different_seeds_differ():
    eng = main_engine()
    prompt = [10, 20, 30]
    a = eng.generate([Request(prompt, sampled(1))])[0].token_ids
    b = eng.generate([Request(prompt, sampled(1))])[0].token_ids
    assert a == b
    others = [eng.generate([Request(prompt, sampled(s))])[0].token_ids for s in range(2, 6)]
    assert all(o != a for o in others)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 2),
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
)
def test_a_request_samples_the_same_alone_and_in_a_mixed_batch(seed, prompt):
    eng = main_engine()
    mine = Request(prompt, sampled(seed, top_k=50, top_p=0.9, temperature=0.8))
    alone = eng.generate([mine])[0].token_ids
    mixed = eng.generate(
        [
            Request([1, 2, 3, 4, 5, 6, 7, 8, 9], greedy(4)),
            mine,
            Request([42], sampled(seed + 1, temperature=1.5)),
        ]
    )
    assert mixed[1].token_ids == alone


def test_measure_generate_runs_before_and_warm_each_untimed():
    """The peer suite runs the peer's repetition in ``before`` (once per call, warm-up
    included) and one of ours right after it (``warm_each``), neither inside a sample."""
    from jaxlab.infer import measure_generate

    eng = variant_engine(1)
    calls: list[int] = []
    real = eng.generate

    def counting(*a, **k):
        calls.append(len(seen))
        return real(*a, **k)

    seen: list[None] = []
    eng.generate = counting  # type: ignore[method-assign]
    try:
        r = measure_generate(
            eng, 1, 4, 3, repeats=3, warmup=2, before=lambda: seen.append(None), warm_each=1
        )
    finally:
        del eng.generate
    # two warm-up calls, then per repetition: before, one untimed call, the timed call
    assert calls == [1, 2, 3, 3, 4, 4, 5, 5], "each call follows its own before()"
    assert len(r["wall_s"]) == 3 and all(v == 0 for v in r["recompiles_while_timed"].values())
