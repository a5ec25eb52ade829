"""The ``xla`` kernel: ``jax.nn.dot_product_attention``, XLA's own fused attention.

The default off the CPU (:func:`jaxlab.kernels.resolve`): XLA recognises the op and fuses
it well on TPU and GPU. It groups query heads over shared K/V heads internally, so nothing
is repeated. The cache is the reference's contiguous ``[B, S, K, D]`` layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlab.kernels.masks import cache_mask, segment_mask
from jaxlab.kernels.reference import ContiguousCache, ContiguousLayout

Array = jax.Array


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None, causal: bool) -> Array:
    return jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, is_causal=causal, implementation="xla"
    )


class Xla(ContiguousLayout):
    name = "xla"

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        mask = None if segment_ids is None else segment_mask(segment_ids)
        return dot_product_attention(q, k, v, mask, causal=True)

    def attend_cache(self, q: Array, cache: ContiguousCache, positions: Array) -> Array:
        mask = cache_mask(positions, cache.k.shape[1])
        return dot_product_attention(q, cache.k, cache.v, jnp.asarray(mask, jnp.bool_), False)


__all__ = ["Xla", "dot_product_attention"]
