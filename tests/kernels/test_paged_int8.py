"""The int8 paged KV pool: both paged kernels read exactly the quantized values that were
written (against the reference attention over the dequantized K/V), and stay within a
bound of attention over the float K/V that is derived from the scales:

* each key and value element is off by at most half its vector's scale, ``s / 2``;
* so each logit is off by at most ``delta = sum_d |q_d| * s_k / 2 / sqrt(D)``, every
  softmax weight moves by a factor within ``exp(+-2 delta)``, and the output (a convex
  combination of values) moves by at most ``max |v| * (exp(2 delta) - 1) + max s_v / 2``.

Also: the pool's bytes, and that staging refuses an int8 pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.kernels import KERNELS, PAGED_KERNELS, int8
from jaxlab.kernels import paged as pg
from jaxlab.kernels.masks import cache_mask
from jaxlab.kernels.reference import attention
from jaxlab.kernels.staged import stage

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)
B, H, D = 3, 4, 8
MAX_LEN, PAGE_SIZE = 40, 8
MAX_PAGES = pg.max_pages_for(MAX_LEN, PAGE_SIZE)
NUM_PAGES = B * MAX_PAGES + 2


@functools.cache
def int8_ops(name: str, n_kv: int, t: int):
    """Write ``k, v [B, MAX_LEN, K, D]`` from position 0 through ``table`` into a zero int8
    pool, attend ``q [B, t, H, D]`` at ``positions``; also the pages read back."""
    kern = PAGED_KERNELS[name]

    def run(table, k, v, q, positions):
        pool = kern.init_pool(NUM_PAGES, PAGE_SIZE, n_kv, D, jnp.int8)
        layer = pg.PagedLayer(pool.k, pool.v, table, pool.k_scale, pool.v_scale)
        layer = kern.write(layer, k, v, jnp.zeros((B,), jnp.int32))
        return kern.attend_cache(q, layer, positions), kern.to_bskd(layer), layer

    return jax.jit(run)


@functools.cache
def contiguous():
    def run(k, v, q, positions):
        return attention(q, k, v, cache_mask(positions, k.shape[1]))

    return jax.jit(run)


def round_trip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per ``[D]`` vector: (dequantized values, scale), as the pool stores them."""
    q, s = int8.quantize(jnp.asarray(x), axis=-1)
    return np.asarray(int8.dequantize(q, s, axis=-1)), np.asarray(s)


def float_bound(q, k, v, positions, n_kv) -> np.ndarray:
    """The module docstring's bound, per ``[B, t, H]`` query, from the data's scales."""
    _, sk = round_trip(k)  # [B, S, K]
    _, sv = round_trip(v)
    g = H // n_kv
    out = np.zeros(q.shape[:3])
    for b in range(B):
        for i, p in enumerate(positions[b]):
            for h in range(H):
                j = h // g
                seen = slice(0, p + 1)
                delta = np.abs(q[b, i, h]).sum() * sk[b, seen, j].max() / 2 / np.sqrt(D)
                vmax = np.abs(v[b, seen, j]).max()
                out[b, i, h] = vmax * np.expm1(2 * delta) + sv[b, seen, j].max() / 2
    return out


@pytest.mark.parametrize("name", list(PAGED_KERNELS))
@pytest.mark.parametrize("n_kv", [1, 2])
@SETTINGS
@given(seed=st.integers(0, 2**16), t=st.sampled_from([1, 3]), scale=st.sampled_from([0.1, 3.0]))
def test_int8_pages_read_what_was_quantized_and_stay_near_float(name, n_kv, seed, t, scale):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(NUM_PAGES)[: B * MAX_PAGES].reshape(B, MAX_PAGES).astype(np.int32)
    k = (scale * rng.standard_normal((B, MAX_LEN, n_kv, D))).astype(np.float32)
    v = (scale * rng.standard_normal((B, MAX_LEN, n_kv, D))).astype(np.float32)
    q = rng.standard_normal((B, t, H, D)).astype(np.float32)
    ends = rng.integers(t - 1, MAX_LEN, B)
    positions = (ends[:, None] - np.arange(t)[::-1][None, :]).astype(np.int32)
    out, (gk, gv), layer = int8_ops(name, n_kv, t)(jnp.asarray(ids), k, v, q, positions)
    assert layer.k.dtype == jnp.int8 and layer.k_scale is not None
    # The pages hold each vector quantized on its own: read back, they are the round trip.
    kq, vq = round_trip(k)[0], round_trip(v)[0]
    np.testing.assert_array_equal(np.asarray(gk), kq)
    np.testing.assert_array_equal(np.asarray(gv), vq)
    # The kernel is attention over those values (paged_xla scales logits and
    # probabilities instead of dequantizing: the same sums).
    exact = contiguous()(kq, vq, q, positions)
    np.testing.assert_allclose(np.asarray(out), np.asarray(exact), atol=2e-6, rtol=1e-5)
    # And close to attention over the float K/V, within the bound the scales give.
    want = np.asarray(contiguous()(k, v, q, positions))
    err = np.abs(np.asarray(out) - want).max(axis=-1)
    assert np.all(err <= float_bound(q, k, v, positions, n_kv) + 1e-5)


def test_int8_rounding_shows_in_attention():
    """The float comparison is not vacuous: a key vector with one large entry rounds its
    small ones to zero, and the logits see it."""
    k = np.zeros((B, MAX_LEN, 1, D), np.float32)
    k[:, :, 0, 0] = 100.0
    k[:, ::2, 0, 1] = 0.3  # 0.3 < 100 / 127 / 2: stored as 0, so every key reads the same
    v = np.random.default_rng(0).standard_normal((B, MAX_LEN, 1, D)).astype(np.float32)
    q = np.zeros((B, 1, H, D), np.float32)
    q[..., 1] = 50.0  # float: the even positions win; int8: a uniform average
    ids = np.arange(B * MAX_PAGES, dtype=np.int32).reshape(B, MAX_PAGES)
    positions = np.full((B, 1), MAX_LEN - 1, np.int32)
    for name in PAGED_KERNELS:
        out, _, _ = int8_ops(name, 1, 1)(jnp.asarray(ids), k, v, q, positions)
        want = np.asarray(contiguous()(k, v, q, positions))
        assert np.abs(np.asarray(out) - want).max() > 0.1


@pytest.mark.parametrize("dtype, ratio", [("float32", 0.27), ("bfloat16", 0.54)])
def test_an_int8_pool_takes_a_quarter_of_float32_and_half_of_bfloat16(dtype, ratio):
    """At head_dim 64 each token's int8 K (or V) of a head is 64 bytes plus a 4-byte scale:
    68 / 256 of float32, 68 / 128 of bfloat16."""
    kern = PAGED_KERNELS["paged_xla"]
    shape = jax.eval_shape(lambda: kern.init_pool(10, 16, 4, 64, jnp.int8))
    float_pool = jax.eval_shape(lambda: kern.init_pool(10, 16, 4, 64, jnp.dtype(dtype)))

    def nbytes(tree) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    assert nbytes(shape) == 2 * 10 * 16 * 4 * (64 + pg.KV_SCALE_BYTES)
    assert nbytes(shape) / nbytes(float_pool) == pytest.approx(
        68 / (64 * jnp.dtype(dtype).itemsize)
    )
    assert nbytes(shape) / nbytes(float_pool) <= ratio


def test_staging_refuses_an_int8_pool():
    pool = pg.init_pool(4, PAGE_SIZE, 1, D, jnp.int8)
    layer = pg.PagedLayer(pool.k, pool.v, jnp.zeros((1, 2), jnp.int32), pool.k_scale, pool.v_scale)
    with pytest.raises(ValueError, match="read page by page"):
        stage(KERNELS["xla_cpu"], layer, 16)
