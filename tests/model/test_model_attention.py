"""Attention primitives: masks, the two ``attend`` implementations, GQA grouping, RoPE, cache write."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlab.model import (
    MASK_VALUE,
    AttentionImpl,
    apply_rope,
    attend,
    cache_mask,
    causal_mask,
    padding_mask,
    rope_tables,
    segment_mask,
    write_cache,
)

# Jit the function under test: one compile per shape instead of one per primitive.
attend_jit = jax.jit(attend, static_argnums=4)


def reference_mha(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Textbook multi-head attention, one head and one row at a time, in float64.

    ``q: [B, T, H, D]``, ``k, v: [B, S, H, D]`` (same head count), ``mask: [B, 1, T, S]``.
    """
    b, t, h, d = q.shape
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            scores = q[bi, :, hi] @ k[bi, :, hi].T / math.sqrt(d)  # [T, S]
            scores = np.where(mask[bi, 0], scores, -1e30)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p = p / p.sum(axis=-1, keepdims=True)
            out[bi, :, hi] = p @ v[bi, :, hi]
    return out


def random_qkv(
    seed: int, b: int, t: int, s: int, h: int, kv: int, d: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    # numpy, not jax.random: eager jax.random compiles a kernel per shape (slow in tests).
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), jnp.float32)
    return q, k, v


def test_mask_helpers() -> None:
    np.testing.assert_array_equal(causal_mask(3)[0, 0], np.tril(np.ones((3, 3), bool)))
    seg = jnp.array([[1, 1, 2]])
    np.testing.assert_array_equal(
        segment_mask(seg)[0, 0],
        np.array([[1, 1, 0], [1, 1, 0], [0, 0, 1]], bool),
    )
    np.testing.assert_array_equal(
        padding_mask(jnp.array([2, 0]), 3)[:, 0, 0],
        np.array([[1, 1, 0], [0, 0, 0]], bool),
    )
    # Cache mask: slot s visible iff s <= query position.
    np.testing.assert_array_equal(
        cache_mask(jnp.array([[1], [3]]), 4)[:, 0, 0],
        np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
    )
    both = causal_mask(3) & segment_mask(seg)
    assert both.shape == (1, 1, 3, 3)
    assert both.dtype == jnp.bool_


@pytest.mark.parametrize("impl", ["einsum", "xla"])
def test_mha_matches_reference(impl: AttentionImpl) -> None:
    # n_kv_heads == n_heads: must equal textbook MHA, with a causal + segment mask.
    q, k, v = random_qkv(0, b=2, t=5, s=5, h=4, kv=4, d=8)
    seg = jnp.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    mask = causal_mask(5) & segment_mask(seg)
    got = attend_jit(q, k, v, mask, impl)
    want = reference_mha(np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["einsum", "xla"])
@pytest.mark.parametrize("n_kv", [1, 2])
def test_gqa_matches_repeated_kv_reference(impl: AttentionImpl, n_kv: int) -> None:
    # Query head h uses KV head h // (H / K): check against explicitly repeated K/V.
    h = 4
    q, k, v = random_qkv(1, b=2, t=3, s=6, h=h, kv=n_kv, d=8)
    mask = cache_mask(jnp.array([[2, 3, 4], [3, 4, 5]]), 6)
    got = attend_jit(q, k, v, mask, impl)
    assert got.shape == (2, 3, h, 8)
    rep = h // n_kv
    want = reference_mha(
        np.asarray(q),
        np.repeat(np.asarray(k), rep, axis=2),
        np.repeat(np.asarray(v), rep, axis=2),
        np.asarray(mask),
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_einsum_and_xla_agree(n_kv: int) -> None:
    q, k, v = random_qkv(2, b=3, t=7, s=7, h=4, kv=n_kv, d=16)
    mask = causal_mask(7) & segment_mask(jnp.array([[0] * 3 + [1] * 4] * 3))
    a = attend_jit(q, k, v, mask, "einsum")
    b = attend_jit(q, k, v, mask, "xla")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_einsum_and_xla_agree_in_bf16() -> None:
    # bf16 inputs: both keep f32 logits/softmax, so they still agree closely.
    q, k, v = random_qkv(2, b=3, t=7, s=7, h=4, kv=2, d=16)
    mask = causal_mask(7)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    ab = attend_jit(qb, kb, vb, mask, "einsum")
    bb = attend_jit(qb, kb, vb, mask, "xla")
    assert ab.dtype == bb.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(ab, np.float32), np.asarray(bb, np.float32), atol=2e-2, rtol=2e-2
    )


def test_fully_masked_row_is_finite() -> None:
    # A padding query that sees nothing must not produce NaN (finite mask value).
    q, k, v = random_qkv(3, b=1, t=2, s=3, h=2, kv=1, d=4)
    mask = jnp.zeros((1, 1, 2, 3), bool)
    for impl in ("einsum", "xla"):
        assert bool(jnp.all(jnp.isfinite(attend_jit(q, k, v, mask, impl))))
    assert math.isfinite(MASK_VALUE)


def test_rope_scores_depend_only_on_relative_position() -> None:
    d = 16
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)

    @jax.jit
    def score_at(m: jax.Array, n: jax.Array) -> jax.Array:
        sq, cq = rope_tables(m.reshape(1, 1), d, 10_000.0)
        sk, ck = rope_tables(n.reshape(1, 1), d, 10_000.0)
        return jnp.sum(apply_rope(q, sq, cq) * apply_rope(k, sk, ck))

    def score(m: int, n: int) -> float:
        return float(score_at(jnp.int32(m), jnp.int32(n)))

    base = score(7, 3)
    for shift in (1, 10, 50):
        assert score(7 + shift, 3 + shift) == pytest.approx(base, abs=1e-4)
    assert score(7, 7) == pytest.approx(float(jnp.sum(q * k)), abs=1e-4)  # zero offset
    # Rotation preserves the norm and the input dtype.
    s, c = rope_tables(jnp.array([[5]]), d, 10_000.0)
    assert float(jnp.linalg.norm(apply_rope(q, s, c))) == pytest.approx(
        float(jnp.linalg.norm(q)), rel=1e-5
    )
    assert apply_rope(q.astype(jnp.bfloat16), s, c).dtype == jnp.bfloat16


def test_write_cache_per_row_offsets() -> None:
    cache = jnp.zeros((2, 6, 1, 2))
    new = jnp.ones((2, 2, 1, 2)) * jnp.array([1.0, 2.0])[:, None, None, None]
    out = write_cache(cache, new, jnp.array([0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(out[0, :, 0, 0]), [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(out[1, :, 0, 0]), [0, 0, 0, 2, 2, 0])


def test_write_cache_over_every_slot_is_the_new_values_whatever_the_start() -> None:
    """A write as long as the cache returns ``new`` (cast to the cache dtype): what
    ``dynamic_update_slice`` gives, since it clamps any start to 0. Prefill relies on it
    to skip materialising a zero cache per layer."""
    cache = jnp.full((2, 3, 1, 2), 7.0, jnp.float32)
    new = jnp.arange(12, dtype=jnp.bfloat16).reshape(2, 3, 1, 2)
    start = jnp.array([0, 2], jnp.int32)
    out = write_cache(cache, new, start)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(new, np.float32))
    clamped = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice(c, n, (i, 0, 0)))(
        cache, new.astype(jnp.float32), start
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clamped))
