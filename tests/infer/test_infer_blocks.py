"""The blocked KV cache: block sizes, the per-block write and the block-skipping attention.

The decode step reads only the first blocks some row can see (``attend_prefix``); these
tests check that this equals dense attention over the whole cache for any per-row
positions, and that the per-block scatter writes exactly one slot per (row, kv head).
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

from jaxlab.infer.fused import attend_prefix, write_rows
from jaxlab.infer.state import (
    MIN_BLOCKED_LEN,
    N_BLOCKS,
    block_starts,
    cache_blocks,
    from_model_cache,
    split_blocks,
)
from jaxlab.model import KVCache

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
B, H, K, D, S = 3, 4, 2, 8, 256  # GQA: 2 query heads per kv head


@given(max_len=st.integers(2, 4096))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_cache_blocks_cover_the_cache(max_len: int) -> None:
    sizes = cache_blocks(max_len)
    assert sum(sizes) == max_len and all(n > 0 for n in sizes)
    if max_len < MIN_BLOCKED_LEN:
        assert sizes == (max_len,)
    else:
        assert len(sizes) <= N_BLOCKS
        assert all(n % 8 == 0 for n in sizes[:-1]) and sizes[-1] <= sizes[0]
    starts = block_starts(sizes)
    assert starts[0] == 0 and all(
        a + n == b for a, n, b in zip(starts, sizes, starts[1:], strict=False)
    )


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Reference: q [B,H,D] over k, v [B*K, S, D] (kv-head major), slots <= pos visible."""
    out = np.zeros_like(q)
    g = H // K
    for b in range(B):
        for h in range(H):
            n = b * K + h // g
            logits = k[n, : pos[b] + 1] @ q[b, h] / math.sqrt(D)
            p = np.exp(logits - logits.max())
            out[b, h] = (p / p.sum()) @ v[n, : pos[b] + 1]
    return out


@functools.cache
def blocked_step():
    def step(q, k_blocks, v_blocks, new_k, new_v, pos):
        k_blocks = write_rows(k_blocks, new_k, pos)
        v_blocks = write_rows(v_blocks, new_v, pos)
        return attend_prefix(q, k_blocks, v_blocks, pos), k_blocks, v_blocks

    return jax.jit(step)


#: Positions at and around every block edge: where the number of blocks read changes.
EDGES = sorted({e + d for e in block_starts(cache_blocks(S)) for d in (-1, 0, 1)} & set(range(S)))
POSITION = st.one_of(st.integers(0, S - 1), st.sampled_from([*EDGES, S - 1]))


@SETTINGS
@example(pos=[0, 0, 0], seed=0)
@example(pos=[S - 1, 0, 5], seed=1)
@given(pos=st.lists(POSITION, min_size=B, max_size=B), seed=st.integers(0, 2**16))
def test_blocked_write_and_attention_equal_dense(pos: list[int], seed: int) -> None:
    check_against_dense(pos, seed)


def test_each_block_edge_as_the_furthest_row() -> None:
    """The furthest row sits exactly on each block's first and last slot (where the
    number of blocks read changes)."""
    for edge in EDGES:
        check_against_dense([edge, 0, max(edge - 3, 0)], seed=edge)


def check_against_dense(pos: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    k = rng.standard_normal((B * K, S, D), dtype=np.float32)
    v = rng.standard_normal((B * K, S, D), dtype=np.float32)
    new_k = rng.standard_normal((B, K, D), dtype=np.float32)
    new_v = rng.standard_normal((B, K, D), dtype=np.float32)
    p = np.asarray(pos, np.int32)

    got, kb, vb = blocked_step()(
        q, split_blocks(jnp.asarray(k)), split_blocks(jnp.asarray(v)), new_k, new_v, jnp.asarray(p)
    )

    k_ref, v_ref = k.copy(), v.copy()
    for b in range(B):
        k_ref[b * K : (b + 1) * K, p[b]] = new_k[b]
        v_ref[b * K : (b + 1) * K, p[b]] = new_v[b]
    np.testing.assert_array_equal(np.concatenate([np.asarray(x) for x in kb], axis=1), k_ref)
    np.testing.assert_array_equal(np.concatenate([np.asarray(x) for x in vb], axis=1), v_ref)
    np.testing.assert_allclose(
        np.asarray(got), dense_attention(q, k_ref, v_ref, p), rtol=2e-5, atol=2e-5
    )


@given(filled=st.integers(1, 96), extra=st.integers(0, 200), seed=st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, derandomize=True)
def test_a_prefill_cache_becomes_the_first_slots_of_the_engine_layout(
    filled: int, extra: int, seed: int
) -> None:
    """Prefill's cache of ``filled`` slots (the bucket) -> blocks over ``max_len`` slots:
    kv-head-major rows, the prefill's slots first, zeros after them."""
    rng = np.random.default_rng(seed)
    max_len = filled + extra
    k = rng.standard_normal((2, filled, K, D), dtype=np.float32)
    v = rng.standard_normal((2, filled, K, D), dtype=np.float32)
    kb, vb = from_model_cache(KVCache(k=(jnp.asarray(k),), v=(jnp.asarray(v),)), max_len)
    for blocks, src in ((kb[0], k), (vb[0], v)):
        assert tuple(b.shape[1] for b in blocks) == cache_blocks(max_len)
        want = np.zeros((2 * K, max_len, D), np.float32)
        want[:, :filled] = src.transpose(0, 2, 1, 3).reshape(2 * K, filled, D)
        np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in blocks], 1), want)


def test_a_prefill_cache_longer_than_max_len_is_refused() -> None:
    a = jnp.zeros((1, 8, K, D))
    with pytest.raises(ValueError, match="shorter than the cache"):
        from_model_cache(KVCache(k=(a,), v=(a,)), 4)
