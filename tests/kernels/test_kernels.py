"""Every attention kernel equals the reference kernel.

Sequence attention (causal, packed segments) and every cache operation (fill, write,
attention over the cache, insert, leading rows) of ``xla``, ``xla_cpu`` and ``xla_tpu``,
and the cache operations of ``pallas``, are checked
against :mod:`jaxlab.kernels.reference` on the same inputs, for MHA, GQA and MQA, with
hypothesis choosing the data: segment boundaries, write starts (past the cache too, where
writes must be dropped) and query positions (at and around the blocked cache's block
edges). The reference itself is checked against textbook float64 attention.

Shapes are fixed per test so each kernel compiles a handful of programs; hypothesis varies
only the data.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxlab import kernels
from jaxlab.kernels import KERNELS, blocked
from jaxlab.kernels.masks import MASK_VALUE, cache_mask, causal_mask, segment_mask
from jaxlab.kernels.reference import attention

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)
FAST = ["xla", "xla_cpu", "xla_tpu"]
#: Kernels whose cache methods are checked here; ``pallas``'s sequence attention (a Pallas
#: kernel, slow to compile in interpret mode) is checked in ``test_pallas_flash.py``.
CACHED = [*FAST, "pallas"]
REF = KERNELS["reference"]
B, H, D = 3, 4, 8
S = 96  # cache slots: the blocked layout splits it into 4 blocks of 24


def normal(seed: int, *shape: int) -> jax.Array:
    # numpy, not jax.random: eager jax.random compiles a kernel per shape (slow in tests).
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ------------------------------------------------------------------- the reference itself


def textbook(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Multi-head attention one head and one row at a time, in float64; K/V heads repeated."""
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, :, hi] @ k[bi, :, hi // g].T / math.sqrt(d)  # [T, S]
            scores = np.where(mask[bi, 0], scores, -1e30)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[bi, :, hi] = (p / p.sum(axis=-1, keepdims=True)) @ v[bi, :, hi // g]
    return out


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_reference_is_textbook_attention(n_kv: int) -> None:
    """Causal + segment masks, and a cache mask with T < S (queries at positions 2..5)."""
    q, k, v = normal(0, 2, 5, H, D), normal(1, 2, 5, n_kv, D), normal(2, 2, 5, n_kv, D)
    mask = causal_mask(5) & segment_mask(jnp.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]))
    want = textbook(*map(np.asarray, (q, k, v, jnp.broadcast_to(mask, (2, 1, 5, 5)))))
    np.testing.assert_allclose(np.asarray(attention(q, k, v, mask)), want, atol=1e-5)
    q3 = q[:, :3]
    mask = cache_mask(jnp.array([[2, 3, 4], [3, 4, 4]]), 5)
    want = textbook(*map(np.asarray, (q3, k, v, mask)))
    np.testing.assert_allclose(np.asarray(attention(q3, k, v, mask)), want, atol=1e-5)


def test_a_fully_masked_row_is_finite() -> None:
    """A query that sees nothing (a padding row) gets a uniform softmax, never NaN."""
    q, k, v = normal(3, 1, 2, 2, 4), normal(4, 1, 3, 1, 4), normal(5, 1, 3, 1, 4)
    none = jnp.zeros((1, 1, 2, 3), bool)
    assert bool(jnp.all(jnp.isfinite(attention(q, k, v, none))))
    assert math.isfinite(MASK_VALUE)


# --------------------------------------------------------------------- sequence attention


@functools.cache
def attend_fn(name: str):
    return jax.jit(lambda q, k, v, seg: KERNELS[name].attend(q, k, v, seg))


def segments(t: int, cuts: list[int]) -> jax.Array:
    """Row 0: one document; rows 1, 2: documents starting at ``cuts`` (and its mirror)."""
    ids = np.zeros((B, t), np.int32)
    for c in cuts:
        ids[1, c:] += 1
        ids[2, t - c :] += 1
    return jnp.asarray(ids)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("n_kv", [1, 2, 4])
@pytest.mark.parametrize("t", [10, 64])  # 64: xla_cpu splits the queries into causal halves
@SETTINGS
@given(seed=st.integers(0, 2**16), cuts=st.lists(st.integers(1, 9), max_size=3))
def test_sequence_attention_equals_the_reference(name, n_kv, t, seed, cuts) -> None:
    q, k, v = (
        normal(seed, B, t, H, D),
        normal(seed + 1, B, t, n_kv, D),
        normal(seed + 2, B, t, n_kv, D),
    )
    seg = segments(t, cuts)
    got = attend_fn(name)(q, k, v, seg)
    want = attend_fn("reference")(q, k, v, seg)
    assert got.shape == (B, t, H, D) and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", [*FAST, "reference"])
def test_no_segments_is_one_segment(name: str) -> None:
    q, k, v = normal(6, B, 64, H, D), normal(7, B, 64, 2, D), normal(8, B, 64, 2, D)
    one = KERNELS[name].attend(q, k, v, None)
    np.testing.assert_allclose(
        np.asarray(one),
        np.asarray(attend_fn(name)(q, k, v, jnp.zeros((B, 64), jnp.int32))),
        atol=2e-6,
    )


@pytest.mark.parametrize("name", FAST)
def test_bf16_inputs_stay_close_to_the_reference(name: str) -> None:
    """bf16 in, bf16 out; logits and softmax stay f32 in every kernel, so they agree closely."""
    q, k, v = (
        x.astype(jnp.bfloat16)
        for x in (normal(9, B, 16, H, D), normal(10, B, 16, 2, D), normal(11, B, 16, 2, D))
    )
    got, want = KERNELS[name].attend(q, k, v), REF.attend(q, k, v)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2
    )


# ------------------------------------------------------------------------ cache operations

#: Positions at and around every block edge of the blocked layout: where the number of
#: blocks it reads changes.
EDGES = sorted(
    {e + d for e in blocked.block_starts(blocked.cache_blocks(S)) for d in (-1, 0, 1)}
    & set(range(S))
)
POSITION = st.one_of(st.integers(0, S - 1), st.sampled_from([*EDGES, S - 1]))


@functools.cache
def cache_ops(name: str, n_kv: int, t: int):
    """fill -> write ``t`` tokens per row at ``start`` -> attend at ``positions``, in one
    program; returns the output and the cache as [B, S, K, D] arrays."""
    kern = KERNELS[name]

    def run(k0, v0, k_new, v_new, start, q, positions):
        cache = kern.fill(k0, v0, S)
        cache = kern.write(cache, k_new, v_new, start)
        return kern.attend_cache(q, cache, positions), kern.to_bskd(cache)

    return jax.jit(run)


@pytest.mark.parametrize("name", CACHED)
@pytest.mark.parametrize("n_kv", [1, 2, 4])
@pytest.mark.parametrize("t", [1, 3])
@SETTINGS
@example(starts=[0, 0, 0], ends=[0, 0, 0], seed=0)
@example(starts=[S - 1, S, S + 5], ends=[S - 1, 3, 40], seed=1)  # writes past the cache drop
@given(
    starts=st.lists(st.integers(0, S + 4), min_size=B, max_size=B),
    ends=st.lists(POSITION, min_size=B, max_size=B),
    seed=st.integers(0, 2**16),
)
def test_cache_fill_write_and_attend_equal_the_reference(name, n_kv, t, starts, ends, seed):
    k0, v0 = normal(seed, B, 40, n_kv, D), normal(seed + 1, B, 40, n_kv, D)
    k_new, v_new = normal(seed + 2, B, t, n_kv, D), normal(seed + 3, B, t, n_kv, D)
    q = normal(seed + 4, B, t, H, D)
    start = jnp.asarray(starts, jnp.int32)
    positions = jnp.asarray(np.asarray(ends)[:, None] - np.arange(t)[::-1][None, :].clip(0))
    positions = jnp.maximum(positions, 0).astype(jnp.int32)
    out, (k, v) = cache_ops(name, n_kv, t)(k0, v0, k_new, v_new, start, q, positions)
    ref_out, (ref_k, ref_v) = cache_ops("reference", n_kv, t)(
        k0, v0, k_new, v_new, start, q, positions
    )
    np.testing.assert_array_equal(np.asarray(k), np.asarray(ref_k))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(ref_v))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-6, rtol=1e-5)
    # The reference's cache, written by hand: the fill, then each slot < S of each row.
    want = np.zeros((B, S, n_kv, D), np.float32)
    want[:, :40] = np.asarray(k0)
    for b in range(B):
        for j in range(t):
            if starts[b] + j < S:
                want[b, starts[b] + j] = np.asarray(k_new)[b, j]
    np.testing.assert_array_equal(np.asarray(ref_k), want)


@pytest.mark.parametrize("name", [*CACHED, "reference"])
def test_insert_and_leading_rows_equal_the_reference(name: str) -> None:
    kern = KERNELS[name]
    n_kv = 2
    big_k, big_v = normal(20, 4, S, n_kv, D), normal(21, 4, S, n_kv, D)
    small_k, small_v = normal(22, 3, 10, n_kv, D), normal(23, 3, 10, n_kv, D)
    cache = kern.fill(big_k, big_v, S)
    rows = kern.fill(small_k, small_v, S)
    slots = jnp.asarray([3, -1, 0], jnp.int32)  # the middle row is skipped
    k, v = kern.to_bskd(kern.insert(cache, rows, slots))
    want_k = np.asarray(big_k).copy()
    want_k[3] = 0.0
    want_k[3, :10] = np.asarray(small_k)[0]
    want_k[0] = 0.0
    want_k[0, :10] = np.asarray(small_k)[2]
    np.testing.assert_array_equal(np.asarray(k), want_k)
    assert np.asarray(v).shape == (4, S, n_kv, D)
    lead_k, _ = kern.to_bskd(kern.take_rows(cache, 2))
    np.testing.assert_array_equal(np.asarray(lead_k), np.asarray(big_k)[:2])


@pytest.mark.parametrize("name", [*CACHED, "reference"])
def test_init_cache_is_zero_in_the_asked_dtype(name: str) -> None:
    cache = KERNELS[name].init_cache(2, S, 1, D, jnp.bfloat16)
    k, v = KERNELS[name].to_bskd(cache)
    assert k.shape == v.shape == (2, S, 1, D) and k.dtype == jnp.bfloat16
    assert not np.asarray(k, np.float32).any()


# -------------------------------------------------------------------------- choosing one


def test_auto_picks_by_platform_and_old_names_still_resolve() -> None:
    assert kernels.resolve("auto", "cpu") == "xla_cpu"
    assert kernels.resolve("auto", "tpu") == "pallas"
    assert kernels.resolve("auto", "gpu") == "xla"
    assert kernels.resolve("einsum", "tpu") == "xla_cpu"  # a config written before kernels
    assert kernels.resolve("reference") == "reference"
    assert kernels.get("auto").name == kernels.resolve("auto", jax.default_backend())
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        kernels.resolve("flash")


LONG = 300  # prefix lengths 128, 256, 300: the switch over visible prefixes


@functools.cache
def long_ops(name: str):
    kern = KERNELS[name]

    def run(k0, v0, q, positions):
        return kern.attend_cache(q, kern.fill(k0, v0, LONG), positions)

    return jax.jit(run)


@pytest.mark.parametrize("name", ["xla", "xla_tpu"])
@SETTINGS
@example(ends=[0, 127, 5], seed=0)  # the shortest prefix
@example(ends=[128, 3, 3], seed=1)  # one row past it
@example(ends=[LONG - 1, 0, 0], seed=2)  # the whole cache
@given(
    ends=st.lists(
        st.sampled_from([0, 1, 126, 127, 128, 129, 255, 256, 257, LONG - 1]), min_size=B, max_size=B
    ),
    seed=st.integers(0, 2**16),
)
def test_reading_only_the_visible_prefix_equals_the_reference(name, ends, seed) -> None:
    """Queries at positions around each prefix length: the kernels that read only the
    leading slots some query can see give what attending over every slot gives."""
    k0, v0 = normal(seed, B, LONG, 2, D), normal(seed + 1, B, LONG, 2, D)
    q = normal(seed + 2, B, 1, H, D)
    positions = jnp.asarray(ends, jnp.int32)[:, None]
    got = long_ops(name)(k0, v0, q, positions)
    want = long_ops("reference")(k0, v0, q, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
