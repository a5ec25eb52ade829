"""The ``xla_tpu`` kernel: a lane-dense decode cache, read by two one-hot-segmented dots.

The default on TPU (:func:`jaxlab.kernels.resolve`); sequence attention is the ``xla``
kernel's. Why a layout of its own (figures in ``docs/performance.md``):

* **No tile padding.** TPU arrays are tiled over their two minor dimensions in
  ``(sublanes, 128 lanes)`` tiles. The contiguous ``[B, S, K, D]`` cache with ``K = 12``
  and ``D = 64`` pads each ``(K, D)`` tile to ``(16, 128)``: 2.7x the bytes to read, on a
  step whose time *is* the bytes it reads. Here one layer's cache is ``[B, S, K * D]``:
  ``K * D`` on the lanes (768 = 6 x 128), nothing padded.
* **No relayout.** Splitting ``K * D`` back into heads would make XLA copy the cache into
  a padded layout first. So for one query per row (decoding) the heads are never split:
  logits are ``cache[b] @ qseg[b]``, where ``qseg[b, c, h] = q[b, h, d]`` for lane
  ``c = k(h) * D + d`` (``k(h)`` the kv head of query head ``h``) and 0 elsewhere, and the
  output is ``p[b]^T @ cache[b]`` followed by picking each head's own ``D`` lanes. Both
  dots stream the cache through the MXU once, with f32 accumulation; the extra
  multiply-adds by zero are free next to the memory traffic.
* Only the visible prefix is read, as in :mod:`jaxlab.kernels.xla`.

More than one query per row (chunked prefill) takes the general path: the heads are split
and ``jax.nn.dot_product_attention`` runs over the prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.kernels.masks import MASK_VALUE, cache_mask
from jaxlab.kernels.reference import insert_rows, write_rows
from jaxlab.kernels.xla import Xla, dot_product_attention, prefix_lengths

Array = jax.Array


@struct.dataclass
class LaneDenseCache:
    """One layer's cache as ``[B, S, K * D]`` buffers; ``n_kv`` is static."""

    k: Array
    v: Array
    n_kv: int = struct.field(pytree_node=False)


def _flat(a: Array) -> Array:
    b, t, k, d = a.shape
    return a.reshape(b, t, k * d)


def _one_query(q: Array, k: Array, v: Array, positions: Array, n_kv: int) -> Array:
    """``q [B, H, D]`` at ``positions [B]`` over ``k, v [B, L, K * D]`` -> ``[B, H, D]``."""
    b, h, d = q.shape
    lanes = n_kv * d
    g = h // n_kv
    # owner[c, h]: lane c holds kv head c // D, which query head h reads iff h // G == c // D
    owner = (jnp.arange(lanes)[:, None] // d) == (jnp.arange(h)[None, :] // g)
    qseg = jnp.where(owner[None], jnp.tile(q, (1, 1, n_kv)).transpose(0, 2, 1), 0)  # [B, KD, H]
    logits = jnp.einsum(
        "blc,bch->blh", k.astype(q.dtype), qseg.astype(q.dtype), preferred_element_type=jnp.float32
    )
    logits = logits * (1.0 / math.sqrt(d))
    visible = jnp.arange(k.shape[1])[None, :] <= positions[:, None]  # [B, L]
    logits = jnp.where(visible[:, :, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=1).astype(q.dtype)
    every = jnp.einsum(
        "blh,blc->bhc", probs, v.astype(q.dtype), preferred_element_type=jnp.float32
    )  # [B, H, K * D]
    mine = every.reshape(b, h, n_kv, d)[:, jnp.arange(h), jnp.arange(h) // g]  # [B, H, D]
    return mine.astype(q.dtype)


class XlaTpu(Xla):
    name = "xla_tpu"

    def init_cache(
        self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> LaneDenseCache:
        shape = (batch, max_len, n_kv_heads * head_dim)
        return LaneDenseCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), n_kv_heads)

    def fill(self, k: Array, v: Array, max_len: int) -> LaneDenseCache:
        pad = ((0, 0), (0, max_len - k.shape[1]), (0, 0))
        return LaneDenseCache(jnp.pad(_flat(k), pad), jnp.pad(_flat(v), pad), k.shape[2])

    def write(self, cache: LaneDenseCache, k: Array, v: Array, start: Array) -> LaneDenseCache:
        return LaneDenseCache(
            write_rows(cache.k, _flat(k), start), write_rows(cache.v, _flat(v), start), cache.n_kv
        )

    def attend_cache(self, q: Array, cache: LaneDenseCache, positions: Array) -> Array:
        b, t, _, d = q.shape
        kv = cache.n_kv

        def over(n: int) -> Callable[[Array, Array, Array, Array], Array]:
            def attend_n(q: Array, k: Array, v: Array, positions: Array) -> Array:
                k, v = k[:, :n], v[:, :n]
                if t == 1:
                    return _one_query(q[:, 0], k, v, positions[:, 0], kv)[:, None]
                split = (b, n, kv, d)
                mask = cache_mask(positions, n)
                return dot_product_attention(q, k.reshape(split), v.reshape(split), mask, False)

            return attend_n

        lengths = prefix_lengths(cache.k.shape[1])
        if len(lengths) == 1:
            return over(lengths[0])(q, cache.k, cache.v, positions)
        index = jnp.sum(jnp.asarray(lengths[:-1]) < jnp.max(positions) + 1)
        branches = [over(n) for n in lengths]
        return jax.lax.switch(index, branches, q, cache.k, cache.v, positions)

    def insert(self, cache: LaneDenseCache, rows: LaneDenseCache, slots: Array) -> LaneDenseCache:
        return LaneDenseCache(
            insert_rows(cache.k, rows.k, slots), insert_rows(cache.v, rows.v, slots), cache.n_kv
        )

    def take_rows(self, cache: LaneDenseCache, r: int) -> LaneDenseCache:
        if r == cache.k.shape[0]:
            return cache
        return LaneDenseCache(cache.k[:r], cache.v[:r], cache.n_kv)

    def to_bskd(self, cache: LaneDenseCache) -> tuple[Array, Array]:
        b, s, _ = cache.k.shape
        return cache.k.reshape(b, s, cache.n_kv, -1), cache.v.reshape(b, s, cache.n_kv, -1)


__all__ = ["LaneDenseCache", "XlaTpu"]
