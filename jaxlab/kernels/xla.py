"""The ``xla`` kernel: ``jax.nn.dot_product_attention``, XLA's own fused attention.

The default off the CPU (:func:`jaxlab.kernels.resolve`): XLA recognises the op and fuses
it well on TPU and GPU, and it groups query heads over shared K/V heads internally, so
nothing is repeated. The cache is the reference's contiguous ``[B, S, K, D]`` layout.

Attention over the cache reads only the leading slots some query can see: the smallest of
a few prefix lengths (powers of two from :data:`MIN_PREFIX`, and ``S``) holding
``max(positions) + 1`` slots, chosen by a ``lax.switch``. A decode step is bound by the
bytes it reads, and a cache of ``max_len`` slots is mostly empty early in a request; the
slots past the prefix are in every query's future, so the result equals attending over
all of them (``docs/performance.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxlab.kernels.masks import cache_mask, segment_mask
from jaxlab.kernels.reference import ContiguousCache, ContiguousLayout

Array = jax.Array

#: The shortest prefix read: shorter ones would add branches for little saving.
MIN_PREFIX = 128


def dot_product_attention(q: Array, k: Array, v: Array, mask: Array | None, causal: bool) -> Array:
    return jax.nn.dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, is_causal=causal, implementation="xla"
    )


def prefix_lengths(s: int) -> tuple[int, ...]:
    """The prefix lengths read from a cache of ``s`` slots: ``(128, 256, ..., s)``."""
    out: list[int] = []
    n = MIN_PREFIX
    while n < s:
        out.append(n)
        n *= 2
    return (*out, s)


class Xla(ContiguousLayout):
    name = "xla"

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        mask = None if segment_ids is None else segment_mask(segment_ids)
        return dot_product_attention(q, k, v, mask, causal=True)

    def attend_cache(self, q: Array, cache: ContiguousCache, positions: Array) -> Array:
        lengths = prefix_lengths(cache.k.shape[1])

        def over(n: int) -> Callable[[Array, Array, Array, Array], Array]:
            def attend_n(q: Array, k: Array, v: Array, positions: Array) -> Array:
                mask = cache_mask(positions, n)
                return dot_product_attention(q, k[:, :n], v[:, :n], mask, causal=False)

            return attend_n

        if len(lengths) == 1:
            return over(lengths[0])(q, cache.k, cache.v, positions)
        index = jnp.sum(jnp.asarray(lengths[:-1]) < jnp.max(positions) + 1)
        branches = [over(n) for n in lengths]
        return jax.lax.switch(index, branches, q, cache.k, cache.v, positions)


__all__ = ["MIN_PREFIX", "Xla", "dot_product_attention", "prefix_lengths"]
