"""Sampling primitives: the top-k/top-p mask against a numpy reference, keys, greedy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxlab.config.ranges import INT32_MAX, SAMPLING_RANGES, Range
from jaxlab.infer import (
    BadRequest,
    Limits,
    Request,
    SamplingParams,
    sample,
    sampling_arrays,
    top_k_top_p_mask,
)
from jaxlab.infer.sampling import argmax, inverse_cdf, row_keys

B, V = 4, 64
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


def reference_mask(logits: np.ndarray, k: int, p: float) -> tuple[np.ndarray, float]:
    """Sort-based numpy reference (float64). Also returns how close the top-p cumulative
    mass came to ``p`` at a decision boundary, so borderline rows can be skipped."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(logits.shape, bool)
    n_k = len(logits) if k <= 0 else min(k, len(logits))
    top = order[:n_k]
    z = logits[top].astype(np.float64)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept = top[before < p] if p < 1.0 else top
    keep[kept] = True
    margin = float(np.min(np.abs(before - p))) if p < 1.0 else 1.0
    return keep, margin


@functools.cache
def jitted_mask():
    return jax.jit(top_k_top_p_mask)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.3, 1.0, 3.0, 10.0]),
    ks=st.lists(st.sampled_from([0, 1, 2, 5, 17, 64, 100]), min_size=B, max_size=B),
    ps=st.lists(st.sampled_from([1.0, 0.95, 0.5, 0.2, 0.01]), min_size=B, max_size=B),
)
def test_top_k_top_p_mask_matches_numpy_reference(seed, scale, ks, ps):
    logits = (np.random.default_rng(seed).normal(size=(B, V)) * scale).astype(np.float32)
    assume(all(len(set(row.tolist())) == V for row in logits))  # no ties
    got = np.asarray(
        jitted_mask()(jnp.asarray(logits), jnp.asarray(ks, jnp.int32), jnp.asarray(ps, jnp.float32))
    )
    for b in range(B):
        want, margin = reference_mask(logits[b], ks[b], ps[b])
        assume(margin > 1e-4)  # float32 vs float64 summation at an exact tie with p
        np.testing.assert_array_equal(got[b], want, err_msg=f"row {b}: k={ks[b]} p={ps[b]}")
        if ks[b] > 0:
            assert got[b].sum() == min(ks[b], V) or ps[b] < 1.0
        assert got[b][np.argmax(logits[b])]  # the most likely token always survives


def test_mask_keeps_ties_and_handles_extremes():
    logits = jnp.asarray(
        [[1.0, 3.0, 3.0, -jnp.inf], [-1.0, -2.0, -3.0, -4.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32
    )
    got = np.asarray(jitted_mask()(logits, jnp.asarray([2, 1, 3]), jnp.asarray([1.0, 1.0, 0.5])))
    np.testing.assert_array_equal(got[0], [False, True, True, False])
    np.testing.assert_array_equal(got[1], [True, False, False, False])
    assert got[2].all()  # all tied: ties at the threshold are kept


def test_argmax_is_first_index_of_the_maximum():
    x = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [-jnp.inf, -1.0, -1.0, -5.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), [1, 1])


@pytest.mark.parametrize("seed", [0, 7, 2**31 - 1])
def test_row_keys_are_fold_in_of_prng_key(seed):
    t = jnp.asarray([0, 5], jnp.int32)
    got = jax.jit(row_keys)(jnp.asarray([seed, seed], jnp.int32), t)
    for i in range(2):
        want = jax.random.fold_in(jax.random.PRNGKey(seed), int(t[i]))
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))


@functools.cache
def jitted_sample():
    return jax.jit(sample)


def draw(logits: np.ndarray, params: list[SamplingParams], t: list[int]) -> np.ndarray:
    sp = sampling_arrays(params)
    return np.asarray(jitted_sample()(jnp.asarray(logits), sp, jnp.asarray(t, jnp.int32)))


def test_sample_is_per_row_and_reproducible():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, V)).astype(np.float32)
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7, top_k=5, seed=4),
        SamplingParams(temperature=1.3, top_p=0.5, seed=5),
    ]
    a = draw(logits, mixed, [0, 1, 2, 3])
    assert a[0] == np.argmax(logits[0])
    np.testing.assert_array_equal(a, draw(logits, mixed, [0, 1, 2, 3]))  # same seeds
    # Row 1 alone (other rows greedy) draws the same: keys depend on (seed, t) only.
    solo = [SamplingParams(temperature=0.0)] * B
    solo[1] = mixed[1]
    assert draw(logits, solo, [9, 1, 9, 9])[1] == a[1]
    # top-k 5 only ever picks from the 5 largest.
    top5 = set(np.argsort(-logits[2])[:5].tolist())
    picks = {int(draw(logits, mixed, [0, 1, t, 3])[2]) for t in range(30)}
    assert picks <= top5 and len(picks) > 1

    # Different seeds give different streams.
    def stream(seed: int) -> list[int]:
        sp = [SamplingParams(temperature=1.0, seed=seed)] * B
        return [int(draw(logits, sp, [t] * B)[0]) for t in range(12)]

    assert stream(3) == stream(3)
    assert stream(3) != stream(99)


def reference_inverse_cdf(logits: np.ndarray, u: float) -> int:
    """float64: the first index whose cumulative softmax mass exceeds ``u``."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max())
    return int(np.searchsorted(np.cumsum(p / p.sum()), u, side="right"))


def test_sampled_token_is_inverse_cdf_with_key_fold_in_seed_t():
    """Row b's t-th token: inverse CDF of ``softmax(logits / T)`` at
    ``u = uniform(fold_in(PRNGKey(seed), t))``."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.5 + b, seed=11 * b + 1) for b in range(B)]
    for ts in ([0, 3, 7, 100], [1, 2, 3, 4], [50, 0, 9, 31]):
        got = draw(logits, params, ts)
        for b in range(B):
            key = jax.random.fold_in(jax.random.PRNGKey(params[b].seed), ts[b])
            u = float(jax.random.uniform(key, ()))
            assert got[b] == reference_inverse_cdf(logits[b] / params[b].temperature, u)


@functools.cache
def jitted_inverse_cdf():
    return jax.jit(inverse_cdf)


@pytest.mark.parametrize("v", [5, 128, 300, 8192])
def test_inverse_cdf_on_a_uniform_grid_reproduces_the_distribution(v: int):
    """Stratified ``u = (i + 1/2) / N``: token ``j`` must be drawn ``N * p_j`` times, give
    or take one per boundary: an exact check of the distribution, no statistics. Several
    vocabulary sizes cover one block, whole blocks and a padded last block."""
    n = 4096
    rng = np.random.default_rng(v)
    row = (rng.normal(size=v) * 2).astype(np.float32)
    row[rng.random(v) < 0.3] = -np.inf  # masked tokens (top-k/top-p): never drawn
    row[0] = 0.0
    u = (np.arange(n, dtype=np.float64) + 0.5) / n
    got = np.asarray(
        jitted_inverse_cdf()(jnp.asarray(np.tile(row, (n, 1))), jnp.asarray(u, jnp.float32))
    )
    p = np.exp(row.astype(np.float64) - row.max())
    p /= p.sum()
    counts = np.bincount(got, minlength=v)
    assert counts[~np.isfinite(row)].sum() == 0
    assert np.all(np.abs(counts - n * p) <= 2.0)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    v=st.sampled_from([3, 127, 129, 1000]),
    u=st.sampled_from([0.0, 0.5, 1.0 - 2.0**-24, 1.0 - 2.0**-23]),
)
def test_inverse_cdf_never_draws_a_masked_token(seed: int, v: int, u: float):
    rng = np.random.default_rng(seed)
    row = (rng.normal(size=v) * 10).astype(np.float32)
    row[rng.random(v) < 0.8] = -np.inf
    row[rng.integers(v)] = 1.0  # at least one token drawable
    got = int(jitted_inverse_cdf()(jnp.asarray(row[None]), jnp.asarray([u], jnp.float32))[0])
    assert np.isfinite(row[got])


def test_eos_is_folded_into_the_stop_tokens_once_unless_ignored():
    sp = SamplingParams(stop_token_ids=(4, 9))
    assert sp.with_eos(7).stop_token_ids == (4, 9, 7)
    assert sp.with_eos(7).with_eos(7).stop_token_ids == (4, 9, 7)
    assert sp.with_eos(None) is sp
    assert SamplingParams(ignore_eos=True).with_eos(7).stop_token_ids == ()
    assert SamplingParams(top_p=0.0).problem() == (
        "top_p",
        "top_p must be a number in [1e-06, 1], 1 = off (got 0.0)",
    )
    assert sp.problem() is None


def _edge_values(valid: Range) -> tuple[list[float], list[object]]:
    """Values of ``valid``'s field just inside and just outside its range, and extremes."""
    if valid.integer:
        lo, hi = int(valid.lo), int(valid.hi)
        return [lo, hi], [lo - 1, hi + 1, 2**63, -(2**63), 10**400, 1.5, True]
    inside = [valid.lo, valid.hi, *([0.0] if valid.zero else [])]
    outside: list[object] = [np.nextafter(valid.hi, np.inf), np.nextafter(valid.lo, -np.inf)]
    outside += [float("inf"), float("-inf"), float("nan"), 1e309, -(10**400), "1"]
    return inside, [v for v in outside if not (valid.zero and v == 0)]


@pytest.mark.parametrize("field", sorted(SAMPLING_RANGES))
def test_every_sampling_value_has_a_range_that_its_device_dtype_holds(field):
    """In range: valid, and its row (the device dtypes) builds and holds the value.
    Outside: ``problem()`` names the field, the range and the value; the request check
    (``Request.create``) refuses it with that message, before any device array."""
    valid = SAMPLING_RANGES[field]
    inside, outside = _edge_values(valid)
    for value in inside:
        sp = SamplingParams(**{field: value})  # type: ignore[arg-type]
        assert sp.problem() is None, value
        held = getattr(sp.row, "max_new" if field == "max_new_tokens" else field)
        assert held == (value if valid.integer else np.float32(value))
    for value in outside:
        sp = SamplingParams(**{field: value})  # type: ignore[arg-type]
        problem = sp.problem()
        assert problem is not None and problem[0] == field, value
        assert problem[1].startswith(f"{field} must be {valid.describe()} (got ")
        with pytest.raises(BadRequest, match=f"^{field} must be") as e:
            Request.create([1], sp, Limits(vocab_size=8, max_len=4))
        assert e.value.param == field


@SETTINGS
@given(
    top_k=st.integers(0, INT32_MAX),
    seed=st.integers(0, INT32_MAX),
    temperature=st.floats(0.01, 100.0),
    top_p=st.floats(1e-6, 1.0),
)
def test_a_valid_request_always_has_a_row(top_k, seed, temperature, top_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    assert sp.problem() is None
    assert (int(sp.row.top_k), int(sp.row.seed)) == (top_k, seed)
    assert np.float32(0) < sp.row.temperature and np.isfinite(sp.row.temperature)
    assert np.float32(0) < sp.row.top_p <= np.float32(1)


def test_a_value_no_dtype_holds_fails_its_row_naming_the_field():
    with pytest.raises(ValueError, match="top_k = 1099511627776 does not fit int32"):
        _ = SamplingParams(top_k=2**40).row
    with pytest.raises(ValueError, match=r"temperature = .* does not fit float32"):
        _ = SamplingParams(temperature=10**400).row
