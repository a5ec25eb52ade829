"""The ``xla_cpu`` kernel: the reference's math in the layouts XLA:CPU compiles best.

The default on the CPU backend (:func:`jaxlab.kernels.resolve`). Three choices, each
tested against the reference (``tests/kernels``), with figures in ``docs/performance.md``:

* **Head-major grouped einsums** for sequence attention. The query heads of one kv head
  become one ``[G * T, D]`` matrix, so both matmuls are plain batched matmuls over
  contiguous slabs and K/V are never repeated; XLA:CPU's backward pass then needs fewer
  transposes than over the ``[B, T, K, G, D]`` layout.
* **Causal halves.** Under a causal mask the first half of the queries cannot see the
  second half of the keys, so it skips them: a quarter less work, the same result up to
  f32 summation order (a skipped key's softmax weight underflows to exactly 0 anyway).
* **The blocked, kv-head-major decode cache** of :mod:`jaxlab.kernels.blocked`.

Softmax reductions run in two stages where the platform wants it
(:mod:`jaxlab.kernels.reduce`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxlab.kernels import blocked
from jaxlab.kernels.blocked import BlockedCache
from jaxlab.kernels.masks import MASK_VALUE, self_attention_mask
from jaxlab.kernels.reduce import softmax_last

Array = jax.Array

#: Causal halves pay from this sequence length on; below it the extra dots cost more.
MIN_HALVED_LEN = 64


def grouped_attention(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """The reference's :func:`~jaxlab.kernels.reference.attention`, head-major and grouped:
    ``q [B, T, H, D]``, ``k, v [B, S, K, D]``, ``mask`` broadcastable to ``[B, 1, T, S]``."""
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    b, t, h, d = q.shape
    s, n_kv = k.shape[1], k.shape[2]
    g = h // n_kv
    qh = q.reshape(b, t, n_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, n_kv, g * t, d)
    kh = k.transpose(0, 2, 1, 3)  # [B, K, S, D]
    vh = v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    if mask is not None:
        # [B|1, 1, T, S] -> [B|1, 1, 1, T, S]: broadcasts over (K, G) of [B, K, G, T, S].
        logits = logits.reshape(b, n_kv, g, t, s)
        logits = jnp.where(mask[:, :, None], logits, MASK_VALUE).reshape(b, n_kv, g * t, s)
    probs = softmax_last(logits).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vh)
    return out.reshape(b, n_kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def causal_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """:func:`grouped_attention` for a ``mask`` that hides every key after its query
    (``T == S``) and shows each query at least one key: two query halves, the first against
    the first half of the keys only."""
    t = q.shape[1]
    if t % 2 or t < MIN_HALVED_LEN:
        return grouped_attention(q, k, v, mask)
    half = t // 2
    m = jnp.broadcast_to(mask, (*mask.shape[:2], t, t))
    lo = grouped_attention(q[:, :half], k[:, :half], v[:, :half], m[:, :, :half, :half])
    hi = grouped_attention(q[:, half:], k, v, m[:, :, half:, :])
    return jnp.concatenate([lo, hi], axis=1)


class XlaCpu:
    name = "xla_cpu"

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        return causal_attention(q, k, v, self_attention_mask(q.shape[1], segment_ids))

    def init_cache(
        self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> BlockedCache:
        return blocked.init(batch, max_len, n_kv_heads, head_dim, dtype)

    def fill(self, k: Array, v: Array, max_len: int) -> BlockedCache:
        return blocked.fill(k, v, max_len)

    def from_pages(
        self, k_pool: Array, v_pool: Array, table: Array, max_len: int
    ) -> BlockedCache | None:
        return blocked.from_pages(k_pool, v_pool, table, max_len)

    def read(self, cache: BlockedCache, positions: Array) -> tuple[Array, Array]:
        return blocked.read(cache, positions)

    def write(self, cache: BlockedCache, k: Array, v: Array, start: Array) -> BlockedCache:
        return blocked.write(cache, k, v, start)

    def attend_cache(self, q: Array, cache: BlockedCache, positions: Array) -> Array:
        return blocked.attend(q, cache, positions)

    def insert(self, cache: BlockedCache, rows: BlockedCache, slots: Array) -> BlockedCache:
        return blocked.insert(cache, rows, slots)

    def take_rows(self, cache: BlockedCache, r: int) -> BlockedCache:
        return blocked.take_rows(cache, r)

    def to_bskd(self, cache: BlockedCache) -> tuple[Array, Array]:
        return blocked.to_bskd(cache)


__all__ = ["MIN_HALVED_LEN", "XlaCpu", "causal_attention", "grouped_attention"]
