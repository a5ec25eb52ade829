"""Speculative decoding through the engine's verbs: greedy output is plain greedy's, token
for token; sampled output follows the model's distribution exactly; after a call the KV
pool holds what plain decoding's holds (rejected positions rolled back) and the page pool's
bookkeeping is the same; the loop compiles once; a request whose drafts are rarely
accepted stops speculating; a draft model of the same tokenizer drafts.

Every engine here has the same small shape (one layer, ``max_len`` 64, pages of 8, three
rows, prompts in the 32 bucket), so they share their executables through the session's
compilation cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from tiny_engines import VOCAB, greedy, make_engine, req, tiny_cfg

from jaxlab.config import SpeculativeConfig
from jaxlab.infer import Chunk, Engine, PagePool, SamplingParams, generate
from jaxlab.infer.speculative import SpeculativeEngine
from jaxlab.infer.speculative.steps import gather_history
from jaxlab.kernels.paged import Pages, gather, present_slots

ROWS = 3
CFG = tiny_cfg(2, 64, [32, 64], 1, page_size=8)
SETTINGS = settings(max_examples=5, deadline=None, derandomize=True)
REPETITIVE = [3] * 20  # the model falls into a loop after it: drafts get accepted
RANDOM = np.random.default_rng(0).integers(0, VOCAB, 24).tolist()


def ngram(**kw: object) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", k=3, ngram_min=1, ngram_max=3, **kw)  # type: ignore[arg-type]


#: The draft method's config (the draft engine is handed over in memory).
DRAFT = SpeculativeConfig(method="draft", k=3, draft_run_dir="(in memory)")


@functools.cache
def target() -> Engine:
    return make_engine(CFG)


@functools.cache
def speculating() -> SpeculativeEngine:
    return SpeculativeEngine(target(), ngram())


@functools.cache
def unstaged_target() -> Engine:
    """The target reading its pages every step (accelerators' form) instead of staging."""
    eng = make_engine(CFG)
    eng.tuning = dataclasses.replace(eng.tuning, staged_pages=False, row_buckets=False)
    return eng


def padded(prompt: list[int]) -> list[int]:
    """``prompt`` cut or padded (with its own tokens) to 17..32 tokens: the 32 bucket."""
    p = list(prompt)[:32] or [1]
    while len(p) < 17:
        p = p + p
    return p[:32]


def same_as_plain(spec: SpeculativeEngine, prompts: list[list[int]], new: int = 30):
    """Greedy generation with and without speculation; asserts equal tokens and returns the
    speculative results."""
    reqs = [req(p, greedy(new), spec.target) for p in prompts]
    plain, fast = generate(spec.target, reqs), generate(spec, reqs)
    for a, b in zip(plain, fast, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    return fast


# ------------------------------------------------------------------------ greedy: identical


@pytest.mark.slow
@SETTINGS
@given(st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=32))
def test_greedy_output_is_plain_greedy_token_for_token(prompt):
    res = same_as_plain(speculating(), [REPETITIVE, RANDOM, prompt])
    usage = [r.speculative for r in res]
    rep, rnd = usage[0], usage[1]
    assert rep is not None and rnd is not None
    # The test can fail: drafts were accepted (the loop after the repetitive prompt) and
    # rejected (the random prompt).
    assert rep.accepted_tokens >= 6, rep
    assert rnd.draft_tokens > rnd.accepted_tokens, rnd


@pytest.mark.slow
def test_greedy_output_is_identical_when_reading_pages_every_step():
    same_as_plain(SpeculativeEngine(unstaged_target(), ngram()), [REPETITIVE, RANDOM, [7] * 17])


def test_the_loop_compiles_once_whatever_the_requests():
    spec = speculating()
    prompts = [REPETITIVE, RANDOM, [5, 6] * 10]
    generate(spec, [req(p, greedy(20), spec.target) for p in prompts])
    before = spec.compiles
    mixes = [
        [greedy(5), greedy(30), SamplingParams(max_new_tokens=12, temperature=0.8, seed=1)],
        [
            SamplingParams(max_new_tokens=30, temperature=1.3, top_k=5, top_p=0.9, seed=s)
            for s in range(3)
        ],
    ]
    for i, sampling in enumerate(mixes):
        reqs = [
            req(padded(p[i:] + p), sp, spec.target) for p, sp in zip(prompts, sampling, strict=True)
        ]
        generate(spec, reqs)
    assert spec.compiles == before
    assert before["spec_generate"] == 1


@pytest.mark.slow
def test_a_request_whose_drafts_are_rarely_accepted_stops_speculating():
    """With a bar no request clears, every request that drafted ``probe_tokens`` tokens stops
    drafting (and says so); its tokens are still plain greedy's."""
    spec = SpeculativeEngine(target(), ngram(min_acceptance=1.0, probe_tokens=3))
    res = same_as_plain(spec, [REPETITIVE, RANDOM, [9, 8, 7] * 7], new=40)
    for r in res:
        u = r.speculative
        assert u is not None
        assert u.switched_off == (u.draft_tokens >= 3 and u.accepted_tokens < u.draft_tokens)
    off = [r.speculative for r in res if r.speculative and r.speculative.switched_off]
    # Every rejection switches it off here: no draft after the verify that rejected one.
    assert off and all(u.draft_tokens - u.accepted_tokens <= 3 for u in off)


# ------------------------------------------------------------------------ the draft model


@functools.cache
def other_model() -> Engine:
    return make_engine(CFG, seed=5)


@pytest.mark.slow
def test_a_draft_model_drafts_and_greedy_output_is_unchanged():
    """The target drafting for itself: every draft is accepted; another model: some are."""
    for draft, all_kept in ((target(), True), (other_model(), False)):
        spec = SpeculativeEngine(target(), DRAFT, draft)
        res = same_as_plain(spec, [REPETITIVE, RANDOM, [4] * 18], new=20)
        drafted = sum(r.speculative.draft_tokens for r in res if r.speculative)
        kept = sum(r.speculative.accepted_tokens for r in res if r.speculative)
        assert drafted > 0
        assert (kept == drafted) == all_kept, (kept, drafted)


def test_a_draft_engine_of_another_shape_is_refused():
    small = make_engine(tiny_cfg(2, 32, [32], 1, page_size=8))
    with pytest.raises(ValueError, match="max_len"):
        SpeculativeEngine(target(), DRAFT, small)


# ------------------------------------------------------------------ sampled: the distribution


#: The Markov chain of :func:`markov_engine` over tokens 0..3: the next token is ``t + 1 mod
#: 4`` with probability ``CYCLE``, each other one of 0..3 with ``(1 - CYCLE) / 3``.
CYCLE = 0.7


def markov_params(graphdef: nnx.GraphDef, params: nnx.State, cycle: float) -> nnx.State:
    """The tiny model turned into a Markov chain over tokens 0..3: every block adds nothing
    (zero output projections), token ``t < 4`` embeds as the unit vector ``e_t`` and the LM
    head's row ``t`` holds the chain's log-probabilities (every other token about -40)."""
    pure = nnx.to_pure_dict(params)
    d = pure["embed"]["table"].shape[1]
    for block in pure["blocks"].values():
        block["attn"]["w_out"] = np.zeros_like(block["attn"]["w_out"])
        block["mlp"]["w_down"] = np.zeros_like(block["mlp"]["w_down"])
    table = np.zeros_like(pure["embed"]["table"])
    table[:4, :4] = np.eye(4)
    table[4:, 4] = 1.0  # tokens the chain never emits
    logp = np.full((4, VOCAB), -40.0)
    for t in range(4):
        logp[t, :4] = np.log((1 - cycle) / 3)
        logp[t, (t + 1) % 4] = np.log(cycle)
    head = np.zeros_like(pure["lm_head"])
    head[:4] = logp / np.sqrt(d)  # the final norm scales e_t by sqrt(d)
    pure["embed"]["table"] = table
    pure["lm_head"] = head
    pure["final_norm"]["scale"] = np.ones_like(pure["final_norm"]["scale"])
    out = jax.tree.map(lambda a: a, params)
    nnx.replace_by_pure_dict(out, jax.tree.map(jnp.asarray, pure))
    return out


@functools.cache
def markov_engine(cycle: float = CYCLE) -> Engine:
    eng = target()
    return Engine(eng.graphdef, markov_params(eng.graphdef, eng.params, cycle), CFG)


def chain(eng: Engine) -> np.ndarray:
    """The engine's own transition matrix over 0..3 (its logits, so rounding is included)."""
    model = nnx.merge(eng.graphdef, eng.params)
    tokens = jnp.arange(4)[:, None]
    probs = jax.nn.softmax(model(tokens, jnp.zeros_like(tokens))[:, 0], axis=-1)
    p = np.asarray(probs, np.float64)
    assert p[:, :4].sum(axis=1).min() > 1 - 1e-6
    return p[:, :4] / p[:, :4].sum(axis=1, keepdims=True)


SAMPLES = 600
PROMPT = [0, 1, 2, 3] * 5


def sampled_tokens(dev: Engine | SpeculativeEngine) -> tuple[np.ndarray, int, int]:
    """``SAMPLES`` sampled continuations of 4 tokens of ``PROMPT`` (seeds 0, 1, ...):
    ``(tokens [SAMPLES, 4], drafted, accepted)``."""
    out, drafted, accepted = [], 0, 0
    eng = markov_engine()
    for call in range(SAMPLES // ROWS):
        sps = [
            SamplingParams(max_new_tokens=4, seed=call * ROWS + r, temperature=1.0)
            for r in range(ROWS)
        ]
        res = generate(dev, [req(PROMPT, sp, eng) for sp in sps])
        for r in res:
            out.append(r.token_ids)
            if r.speculative is not None:
                drafted += r.speculative.draft_tokens
                accepted += r.speculative.accepted_tokens
    return np.asarray(out), drafted, accepted


@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain", "ngram", "draft"])
def test_sampled_tokens_follow_the_model_distribution(method):
    """Each of the first four tokens' marginal, against the chain's exact marginal
    (chi-square, fixed seeds). Prompt lookup drafts the cycle (a point mass), the draft
    model is the chain with another cycle probability (a proposal unlike the target)."""
    eng = markov_engine()
    dev: Engine | SpeculativeEngine = eng
    if method == "ngram":
        dev = SpeculativeEngine(eng, ngram())
    elif method == "draft":
        draft = markov_engine(0.4)
        dev = SpeculativeEngine(eng, DRAFT, draft)
    tokens, drafted, accepted = sampled_tokens(dev)
    if method != "plain":  # both branches of the rule ran, often
        assert 0.2 * drafted < accepted < 0.9 * drafted, (accepted, drafted)
    p = chain(eng)
    marginal = p[3]  # after the prompt's last token
    for i in range(4):
        observed = np.bincount(tokens[:, i], minlength=VOCAB)
        assert observed[4:].sum() == 0
        pvalue = stats.chisquare(observed[:4], marginal * len(tokens)).pvalue
        assert pvalue > 1e-3, (i, observed[:4], marginal)
        marginal = marginal @ p


def test_the_chi_square_test_tells_a_wrong_rule_apart():
    """The same check on tokens whose drafts were always kept (the drafts' distribution, not
    the model's) fails: the test above has power."""
    eng = markov_engine()
    p = chain(eng)
    # Always keeping prompt lookup's draft makes token 1 the cycle's successor of token 0.
    rng = np.random.default_rng(0)
    first = rng.choice(4, SAMPLES, p=p[3])
    second = (first + 1) % 4
    marginal = p[3] @ p
    pvalue = stats.chisquare(np.bincount(second, minlength=4), marginal * SAMPLES).pvalue
    assert pvalue < 1e-6


# ------------------------------------------------------------ the caches after a speculation


def decode_in_chunks(dev: Any, prompts: list[list[int]], new: int, n: int):
    """A scheduler's way over the verbs: each row's pages grown before each call to cover
    its position plus ``n`` (at most its prompt plus budget), calls of ``n`` tokens until
    every row is done. Returns ``(state, page pool, tokens per row)``."""
    ps = dev.page_size
    num_pages = ROWS * dev.max_pages
    pool = PagePool(num_pages, ps)
    state = dev.init_decode_state(ROWS, num_pages)
    chunks = []
    for i, p in enumerate(prompts):
        got = pool.admit(i, p)
        assert got is not None
        chunks.append(Chunk(p, 0, got.pages, greedy(new)))
    state, pre = dev.prefill(state, chunks)
    state = dev.insert(pre, state, list(range(ROWS)))
    tokens = [[int(t)] for t in np.asarray(pre.tokens)[:ROWS]]
    table = np.full((ROWS, dev.max_pages), num_pages, np.int32)
    while any(len(t) < new for t in tokens):
        for i, p in enumerate(prompts):
            position = len(p) + len(tokens[i]) - 1
            assert pool.grow(i, min(len(p) + new - 1, position + n))
            table[i, : len(pool.pages(i))] = pool.pages(i)
        state = dev.set_table(state, table)
        state, out, *_ = dev.generate(state, n)
        for i, col in enumerate(np.asarray(out).T):
            tokens[i] += [int(t) for t in col if t >= 0]
    return state, pool, tokens


def row_contents(state_cache: Pages) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's K/V of every row as its table shows them, ``[B, S, K, D]``, positions
    without a page zeroed (page ids may differ between two runs, contents may not)."""
    out = []
    for i in range(len(state_cache.pools)):
        layer = state_cache.layer(i)
        k, v = gather(layer)
        present = np.asarray(present_slots(layer.table, layer.num_pages, layer.page_size))
        mask = present[:, :, None, None]
        out.append((np.where(mask, k, 0.0), np.where(mask, v, 0.0)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "pages-every-step"])
def test_after_speculation_the_caches_equal_plain_decodings(staged):
    """Same requests, pages grown the same way, calls of 8 tokens: the same tokens and rows'
    state; every row's pages hold plain decoding's K/V (the kept positions within rounding,
    every other position untouched: rejected drafts were rolled back, not left behind);
    the token pool holds each row's tokens; the page pool's bookkeeping (pages per row,
    refcounts, free list) is plain decoding's."""
    eng = target() if staged else unstaged_target()
    prompts = [REPETITIVE, RANDOM, [6] * 18]
    new = 30
    plain_state, plain_pool, plain_tokens = decode_in_chunks(eng, prompts, new, 8)
    spec = SpeculativeEngine(eng, ngram())
    state, pool, tokens = decode_in_chunks(spec, prompts, new, 8)
    assert tokens == plain_tokens
    t = state.target
    for field in ("tokens", "pos", "generated", "done"):
        np.testing.assert_array_equal(getattr(t, field), getattr(plain_state, field))
    mine, theirs = row_contents(t.cache), row_contents(plain_state.cache)
    for (k, v), (pk, pv) in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(k, pk, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, pv, rtol=1e-5, atol=1e-5)
    assert int(np.asarray(state.drafted).sum()) > int(np.asarray(state.accepted).sum()) > 0
    history = np.asarray(gather_history(state.history, t.table))
    for i, p in enumerate(prompts):
        seq = p + tokens[i][:-1]  # every token but the last one is in the cache
        assert int(t.pos[i]) == len(seq)
        assert history[i, : len(seq)].tolist() == seq
    pool.check()
    assert pool.free == plain_pool.free
    assert [len(pool.pages(i)) for i in range(ROWS)] == [
        len(plain_pool.pages(i)) for i in range(ROWS)
    ]
    refs = sorted(pool.refcount(p) for p in range(pool.num_pages))
    assert refs == sorted(plain_pool.refcount(p) for p in range(plain_pool.num_pages))


def test_rejected_drafts_never_reach_pages_the_rows_do_not_hold():
    """With every page lent up front (offline's way), page ids are the same in both runs:
    the whole pools compare equal, pages no row decodes into included."""
    prompts = [REPETITIVE, RANDOM, [6] * 18]
    reqs = [req(p, greedy(30)) for p in prompts]
    for eng in (target(), unstaged_target()):
        spec = SpeculativeEngine(eng, ngram())
        states = []
        devices: list[Any] = [eng, spec]
        for dev in devices:
            state, pre = dev.prefill(
                dev.init_decode_state(ROWS, ROWS * eng.max_pages),
                [
                    Chunk(r.prompt_ids, 0, list(range(i * 8, i * 8 + 7)), r.sampling)
                    for i, r in enumerate(reqs)
                ],
            )
            state = dev.insert(pre, state, list(range(ROWS)))
            state, *_ = dev.generate(state, 64)
            states.append(getattr(state, "target", state))  # the engine's DecodeState
        for mine, theirs in zip(states[1].cache.pools, states[0].cache.pools, strict=True):
            np.testing.assert_allclose(mine.k, theirs.k, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(mine.v, theirs.v, rtol=1e-5, atol=1e-5)
