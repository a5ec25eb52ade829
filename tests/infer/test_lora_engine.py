"""LoRA adapters through the engine's verbs: rows of different adapters share one batched
prefill and decode, each row gets exactly what it gets alone, a base row is the model
without adapters, mixing adapters compiles nothing new, and the prefix cache never shares
pages across adapters."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_engines import greedy, numpy_params, tiny_cfg

from jaxlab.config import SpeculativeConfig
from jaxlab.infer import Engine, PagePool, Request
from jaxlab.infer.offline import generate
from jaxlab.model import lora
from jaxlab.serve.scheduler import adapter_salt

PROMPTS = ([5, 9, 77, 3, 8, 1, 2], [40, 41, 42], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])


def random_adapter(cfg, rank: int, targets: tuple[str, ...], seed: int) -> lora.Weights:
    """An adapter with ``B != 0`` (as after training), big enough to change greedy tokens."""
    w = lora.init_weights(cfg.model, rank, targets, jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 100)
    return {
        n: {"a": p["a"], "b": 0.3 * jax.random.normal(jax.random.fold_in(key, i), p["b"].shape)}
        for i, (n, p) in enumerate(w.items())
    }


@functools.cache
def engines() -> tuple[Engine, Engine]:
    """``(with two adapters, without)`` over the same base weights: adapter 1 of rank 4 on
    q and v, adapter 2 of rank 2 on o and the MLP."""
    cfg = tiny_cfg(2, 64, [16, 64])
    graphdef, params = numpy_params(cfg, 0)
    stacked = lora.stack(
        cfg.model,
        [
            (random_adapter(cfg, 4, ("q", "v"), 1), 2.0),
            (random_adapter(cfg, 2, ("o", "mlp"), 2), 1.0),
        ],
    )
    return Engine(graphdef, params, cfg, adapters=stacked), Engine(graphdef, params, cfg)


def run(eng: Engine, rows: list[tuple[int, int]], n: int = 8) -> list[list[int]]:
    """Greedy tokens of ``(prompt index, adapter)`` rows generated as one batch (3 rows: the
    shapes every call here shares)."""
    reqs = [Request.create(PROMPTS[p], greedy(n), eng.limits(), adapter=a) for p, a in rows]
    return [list(r.token_ids) for r in generate(eng, reqs)]


@settings(max_examples=4, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), min_size=3, max_size=3))
def test_a_mixed_adapter_batch_equals_each_request_served_alone(rows):
    eng, base = engines()
    mixed = run(eng, rows)
    for (p, a), got in zip(rows, mixed, strict=True):
        alone = run(eng, [(p, a), (p, a), (p, a)])[0]
        assert got == alone
        if a == 0:  # a base row is the model without adapters, token for token
            assert got == run(base, [(p, 0)] * 3)[0]


def test_adapters_change_the_output_and_mixing_them_compiles_nothing():
    eng, _ = engines()
    first = run(eng, [(0, 0), (0, 1), (0, 2)])
    assert len({tuple(t) for t in first}) == 3  # each adapter answers its own way
    compiles = dict(eng.compiles)
    run(eng, [(1, 2), (2, 0), (0, 1)])
    run(eng, [(2, 1), (2, 1), (1, 2)])
    assert eng.compiles == compiles  # adapter ids are data, not shapes


def test_an_adapter_id_the_engine_does_not_hold_is_refused():
    eng, base = engines()
    with pytest.raises(ValueError, match="adapter id 3 out of range"):
        run(eng, [(0, 3)] * 3)
    with pytest.raises(ValueError, match="adapter id 1 out of range"):
        run(base, [(0, 1)] * 3)


def test_speculation_refuses_an_engine_with_adapters():
    from jaxlab.infer.speculative import SpeculativeEngine

    eng, _ = engines()
    with pytest.raises(ValueError, match="cannot serve LoRA adapters"):
        SpeculativeEngine(eng, SpeculativeConfig(method="ngram"))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(0, 255), min_size=9, max_size=40),
    st.integers(0, 3),
    st.integers(0, 3),
)
def test_the_prefix_cache_shares_pages_only_within_one_adapter(tokens, a, b):
    pool = PagePool(32, 4, prefix_caching=True)
    pool.admit("first", tokens, salt=adapter_salt(a))
    pool.commit("first", tokens, len(tokens))
    got = pool.admit("second", tokens, salt=adapter_salt(b))
    assert got is not None
    full = (len(tokens) - 1) // 4 * 4
    assert got.cached_tokens == (full if a == b else 0)


def test_prefix_cached_prompts_under_two_adapters_each_get_their_own_answer():
    """Through a pool with prefix caching: a prompt computed under adapter 1, then the same
    prompt under adapter 2 (no hit: its own K/V) and again under 1 (a hit): each answer is
    the one its adapter gives alone without a cache."""
    from jaxlab.infer import Chunk

    eng, _ = engines()
    prompt = PROMPTS[2] * 2  # 22 tokens: a page of 16 can be shared
    refs = {}
    for a in (1, 2):
        r = Request.create(prompt, greedy(6), eng.limits(), adapter=a)
        refs[a] = list(generate(eng, [r, r, r])[0].token_ids)
    assert refs[1] != refs[2]
    pool = PagePool(eng.pool_pages(3), eng.page_size, prefix_caching=True)
    state = eng.init_decode_state(3, pool.num_pages)
    table = np.full((3, eng.max_pages), pool.num_pages, np.int32)
    out = {}
    for slot, a in enumerate((1, 2, 1)):
        got = pool.admit(slot, prompt, reserve=6, salt=adapter_salt(a))
        assert got is not None
        assert got.cached_tokens == (16 if slot == 2 else 0)
        c = got.cached_tokens
        chunk = Chunk(prompt[c:], c, got.pages, greedy(6), adapter=a)
        state, pre = eng.prefill(state, [chunk])
        pool.commit(slot, prompt, len(prompt))
        out[slot] = [int(np.asarray(pre.tokens)[0])]
        state = eng.insert(pre, state, [slot])
        table[slot, : len(got.pages)] = got.pages
    state = eng.set_table(state, table)
    while True:
        state, toks, done = eng.generate(state, 4)
        for slot in out:
            out[slot] += [int(t) for t in np.asarray(toks)[:, slot] if t >= 0]
        if np.asarray(done).all():
            break
    assert [out[0], out[1], out[2]] == [refs[1], refs[2], refs[1]]


def test_int8_weights_serve_adapters_on_the_quantized_base():
    """``inference.weights = "int8"`` with adapters: the base is quantized, the adapters'
    low-rank products stay float beside it. A base row is the int8 model without
    adapters, token for token; each adapter still answers its own way; a mixed batch gives
    each row what it gets alone."""
    cfg = tiny_cfg(2, 64, [16, 64])
    cfg = cfg.model_copy(update={"inference": cfg.inference.model_copy(update={"weights": "int8"})})
    graphdef, params = numpy_params(cfg, 0)
    stacked = lora.stack(
        cfg.model,
        [
            (random_adapter(cfg, 4, ("q", "v"), 1), 2.0),
            (random_adapter(cfg, 2, ("o", "mlp"), 2), 1.0),
        ],
    )
    eng = Engine(graphdef, params, cfg, adapters=stacked)
    base = Engine(graphdef, params, cfg)
    assert eng.weights_format == base.weights_format == "int8"
    mixed = run(eng, [(0, 0), (0, 1), (0, 2)])
    assert mixed[0] == run(base, [(0, 0)] * 3)[0]
    assert len({tuple(t) for t in mixed}) == 3
    for a in (1, 2):
        assert mixed[a] == run(eng, [(0, a)] * 3)[0]
