"""The reference kernel: attention as the textbook writes it, over a contiguous cache.

This is the specification every other kernel is tested against. It favours being obviously
right over being fast: K/V heads are repeated to the query heads, logits are one einsum, the
mask is applied literally, softmax is ``jax.nn.softmax``.

Its cache, :class:`ContiguousCache`, is the plain layout ``[B, S, K, D]`` per layer; the
``xla`` kernel shares it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.kernels.masks import MASK_VALUE, cache_mask, self_attention_mask

Array = jax.Array


def attention(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
    """``softmax(q k^T / sqrt(D)) v`` with grouped KV heads and a boolean mask.

    ``q [B, T, H, D]``, ``k, v [B, S, K, D]``, ``mask`` broadcastable to ``[B, 1, T, S]``
    (``True`` = attend; None = no mask) -> ``[B, T, H, D]``. Precision as in
    :mod:`jaxlab.kernels.base`.
    """
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k.astype(q.dtype), g, axis=2)  # query head h reads kv head h // g
    v = jnp.repeat(v.astype(q.dtype), g, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


@struct.dataclass
class ContiguousCache:
    """One layer's cache as two ``[B, S, K, D]`` buffers."""

    k: Array
    v: Array


def write_rows(buf: Array, new: Array, start: Array) -> Array:
    """``new [B, T, K, D]`` into ``buf [B, S, K, D]`` at slots ``start[b] + t``; slots past
    ``S`` are dropped. One scatter with unique, sorted indices: in place when donated."""
    b, t = new.shape[:2]
    rows = jnp.arange(b)[:, None]
    cols = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return buf.at[rows, cols].set(
        new.astype(buf.dtype), mode="drop", unique_indices=True, indices_are_sorted=True
    )


def insert_rows(buf: Array, rows: Array, slots: Array) -> Array:
    """Row ``i`` of ``rows`` into row ``slots[i]`` of ``buf``; negative slots are skipped."""
    idx = jnp.where(slots >= 0, slots, buf.shape[0])  # out of range -> dropped
    return buf.at[idx].set(rows.astype(buf.dtype), mode="drop")


class ContiguousLayout:
    """The cache methods of a kernel whose cache is :class:`ContiguousCache`."""

    def init_cache(
        self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> ContiguousCache:
        shape = (batch, max_len, n_kv_heads, head_dim)
        return ContiguousCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def fill(self, k: Array, v: Array, max_len: int) -> ContiguousCache:
        pad = ((0, 0), (0, max_len - k.shape[1]), (0, 0), (0, 0))
        return ContiguousCache(jnp.pad(k, pad), jnp.pad(v, pad))

    def write(self, cache: ContiguousCache, k: Array, v: Array, start: Array) -> ContiguousCache:
        return ContiguousCache(write_rows(cache.k, k, start), write_rows(cache.v, v, start))

    def insert(
        self, cache: ContiguousCache, rows: ContiguousCache, slots: Array
    ) -> ContiguousCache:
        return ContiguousCache(
            insert_rows(cache.k, rows.k, slots), insert_rows(cache.v, rows.v, slots)
        )

    def take_rows(self, cache: ContiguousCache, r: int) -> ContiguousCache:
        return cache if r == cache.k.shape[0] else ContiguousCache(cache.k[:r], cache.v[:r])

    def to_bskd(self, cache: ContiguousCache) -> tuple[Array, Array]:
        return cache.k, cache.v


class Reference(ContiguousLayout):
    """The specification (module docstring)."""

    name = "reference"

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        return attention(q, k, v, self_attention_mask(q.shape[1], segment_ids))

    def attend_cache(self, q: Array, cache: ContiguousCache, positions: Array) -> Array:
        return attention(q, cache.k, cache.v, cache_mask(positions, cache.k.shape[1]))


__all__ = [
    "ContiguousCache",
    "ContiguousLayout",
    "Reference",
    "attention",
    "insert_rows",
    "write_rows",
]
