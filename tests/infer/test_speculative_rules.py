"""Speculative decoding's pure pieces: the acceptance rule reproduces the target distribution
(chi-square against synthetic ``p``/``q``, fixed seeds), greedy rows keep exactly the argmax
prefix, and prompt lookup finds what a plain Python search finds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from jaxlab.infer.sampling import SamplingArrays, SamplingParams, sampling_arrays
from jaxlab.infer.speculative.accept import accept
from jaxlab.infer.speculative.ngram import lookup

#: Draws per chi-square test (rows of one batched call).
N = 40_000
V = 6
#: A fit is rejected below this p-value; every test here is deterministic (fixed seeds).
ALPHA = 1e-3
#: One compile per shape (eager, every op of the rule would compile on its own).
ACCEPT = jax.jit(accept)
LOOKUP = jax.jit(lookup, static_argnums=(3, 4, 5))


def rows(n: int, **kw: float) -> SamplingArrays:
    """``n`` rows sampling at ``kw`` with seeds ``0 .. n - 1``."""
    base = sampling_arrays([SamplingParams(max_new_tokens=8, **kw)])  # type: ignore[arg-type]
    sp = jax.tree.map(lambda a: jnp.repeat(a, n, axis=0), base)
    return sp.replace(seed=jnp.arange(n, dtype=jnp.int32))


def fits(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness-of-fit p-value of the counts ``observed`` against probabilities
    (tokens of probability 0 must not be observed at all)."""
    support = expected_probs > 0
    assert observed[~support].sum() == 0, "a token of probability 0 was emitted"
    exp = expected_probs[support] * observed.sum()
    return float(stats.chisquare(observed[support], exp).pvalue)


def counts(tokens: np.ndarray, v: int = V) -> np.ndarray:
    return np.bincount(tokens, minlength=v)[:v]


P = np.array(
    [
        [0.30, 0.25, 0.20, 0.15, 0.07, 0.03],  # p_0
        [0.05, 0.10, 0.40, 0.05, 0.30, 0.10],  # p_1 (given d_1 accepted)
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],  # p_2: the bonus
    ]
)
Q = np.array(
    [
        [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],  # a draft unlike the target
        [0.10, 0.10, 0.30, 0.10, 0.30, 0.10],
    ]
)


@functools.cache
def verified(temperature: float = 1.0, top_k: int = 0, point_mass: bool = False):
    """``N`` rows verifying two drafts against ``log P``: drafts drawn from ``Q`` (numpy,
    fixed seed) or, with ``point_mass``, fixed tokens (prompt lookup's deterministic
    proposal). Returns host ``(tokens [N, 3], accepted [N], drafts [N, 2])``."""
    rng = np.random.default_rng(0)
    if point_mass:
        drafts = np.tile(np.array([[1, 2]]), (N, 1))
        q = None
    else:
        drafts = np.stack([rng.choice(V, N, p=Q[i]) for i in range(2)], axis=1)
        q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (N, 2, V))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(P, jnp.float32)) * temperature, (N, 3, V))
    sp = rows(N, temperature=temperature, top_k=top_k)
    has = jnp.ones((N,), jnp.bool_)
    t = jnp.full((N,), 5, jnp.int32)
    tokens, nacc = ACCEPT(logits, jnp.asarray(drafts, jnp.int32), q, has, sp, t)
    return np.asarray(tokens), np.asarray(nacc), drafts


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-q", "point-mass"])
def test_the_first_emitted_token_follows_the_target_distribution(point_mass):
    tokens, nacc, drafts = verified(point_mass=point_mass)
    assert 0.05 < (nacc > 0).mean() < 0.95  # both branches of the rule ran
    assert fits(counts(tokens[:, 0]), P[0]) > ALPHA
    # The test has power: the drafts' own distribution is told apart from p_0.
    if not point_mass:
        assert fits(counts(drafts[:, 0]), P[0]) < 1e-12


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-q", "point-mass"])
def test_later_tokens_follow_the_target_given_the_drafts_before_them(point_mass):
    """Given ``d_1`` was kept, the next emitted token follows ``p_1``; given both were, the
    bonus follows ``p_2``."""
    tokens, nacc, _ = verified(point_mass=point_mass)
    second = tokens[nacc >= 1, 1]
    assert fits(counts(second), P[1]) > ALPHA
    third = tokens[nacc == 2, 2]
    if point_mass:  # P(both kept) = p_0(1) p_1(2)
        assert len(third) > 1000
    assert fits(counts(third), P[2]) > ALPHA


def test_top_k_and_temperature_are_the_target_distribution_accepted_against():
    """The target is the row's filtered distribution: top-2 of ``p_0`` at temperature 0.7."""
    tokens, _, _ = verified(temperature=0.7, top_k=2)
    z = np.log(P[0]) * 0.7 / 0.7  # the logits are log P scaled by T, then divided by T
    keep = np.argsort(-z)[:2]
    want = np.zeros(V)
    want[keep] = np.exp(z[keep]) / np.exp(z[keep]).sum()
    assert fits(counts(tokens[:, 0]), want) > ALPHA


def test_a_row_without_drafts_draws_exactly_what_plain_sampling_draws():
    from jaxlab.infer.sampling import sample

    n = 512
    logits = jax.random.normal(jax.random.PRNGKey(3), (n, 3, 50)) * 3
    sp = rows(n, temperature=0.9, top_p=0.9)
    t = jnp.arange(n, dtype=jnp.int32) % 7
    drafts = jnp.zeros((n, 2), jnp.int32)
    tokens, nacc = ACCEPT(logits, drafts, None, jnp.zeros((n,), jnp.bool_), sp, t)
    assert int(nacc.max()) == 0
    np.testing.assert_array_equal(tokens[:, 0], jax.jit(sample)(logits[:, 0], sp, t))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 3]))
def test_greedy_rows_keep_the_drafts_that_are_the_argmax_then_take_the_argmax(seed, k):
    rng = np.random.default_rng(seed)
    b, v = 16, 9
    logits = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    best = logits.argmax(-1)
    # Each draft is the argmax with probability 1/2, so prefixes of every length occur.
    drafts = np.where(rng.random((b, k)) < 0.5, best[:, :k], (best[:, :k] + 1) % v)
    has = rng.random(b) < 0.8
    tokens, nacc = ACCEPT(
        jnp.asarray(logits),
        jnp.asarray(drafts),
        None,
        jnp.asarray(has),
        rows(b),
        jnp.zeros(b, jnp.int32),
    )
    tokens, nacc = np.asarray(tokens), np.asarray(nacc)
    for r in range(b):
        want = 0
        while has[r] and want < k and drafts[r, want] == best[r, want]:
            want += 1
        assert nacc[r] == want
        assert list(tokens[r, :want]) == list(drafts[r, :want])
        assert tokens[r, want] == best[r, want]


# ------------------------------------------------------------------------- prompt lookup


def lookup_reference(seq: list[int], k: int, n_min: int, n_max: int) -> list[int] | None:
    """The latest earlier match of the longest suffix n-gram, its continuation read
    periodically; None without a match. ``seq`` ends with the current token."""
    pos = len(seq) - 1
    for n in range(n_max, n_min - 1, -1):
        if pos < n:
            continue
        suffix = seq[pos - n + 1 :]
        for j in range(pos - 1, n - 2, -1):
            if seq[j - n + 1 : j + 1] == suffix:
                return [seq[j + 1 + i % (pos - j)] for i in range(k)]
    return None


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.sampled_from([1, 4]),
    st.sampled_from([1, 2]),
    st.sampled_from([0, 2]),
)
def test_lookup_equals_a_python_search(seq, k, n_min, extra):
    n_max = n_min + extra
    s = 32
    history = np.full((1, s), 7, np.int32)  # past pos: stale values, never matched
    history[0, : len(seq) - 1] = seq[:-1]
    drafts, found = LOOKUP(
        jnp.asarray(history),
        jnp.asarray([seq[-1]], jnp.int32),
        jnp.asarray([len(seq) - 1], jnp.int32),
        k,
        n_min,
        n_max,
    )
    want = lookup_reference(seq, k, n_min, n_max)
    assert bool(found[0]) == (want is not None)
    if want is not None:
        assert list(np.asarray(drafts[0])) == want


def test_lookup_drafts_the_continuation_of_a_repeated_phrase():
    seq = [9, 1, 2, 3, 4, 5, 8, 1, 2, 3]
    history = jnp.asarray([seq[:-1] + [0] * 6], jnp.int32)
    drafts, found = LOOKUP(history, jnp.asarray([3]), jnp.asarray([9]), 3, 2, 3)
    assert bool(found[0]) and list(np.asarray(drafts[0])) == [4, 5, 8]
