"""Pages staged into a contiguous cache for the length of one decode call (XLA:CPU).

XLA:CPU reads a buffer in place only when a dot takes the whole buffer; every other read is
a copy first. So the paged kernels copy the pages a step reads (a gather) before their dots,
every layer, every step, where a contiguous cache is read in place; at a dozen rows that copy
is as large as the weights a step reads (``docs/performance.md``). Staging pays it once per
decode call instead:

1. the call gathers each computed row's pages into the contiguous kernel's own cache
   (:func:`stage`);
2. every step reads that cache in place, as a contiguous cache is read, and writes its new
   K/V there and into a small ``recent`` buffer of the call's ``k`` positions per row
   (:class:`Staged`); the pool is not touched;
3. after the last step the ``recent`` K/V go into the pages in one scatter per buffer
   (:func:`jaxlab.kernels.paged.write_at`), and the staged cache is dropped.

Between calls the decode state holds pages only; while a call runs it also holds a
contiguous cache of its computed rows. The pool being only read during the loop matters
too: the loop can then run inside a ``lax.switch`` (over row counts) without XLA copying
the pool in and out of it.

Which platforms stage is a tuning choice (:attr:`jaxlab.runtime.tuning.Tuning.staged_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxlab.kernels.base import AttentionKernel, LayerCache
from jaxlab.kernels.paged import PagedLayer, gather

Array = jax.Array


@struct.dataclass
class StagedLayer:
    """One layer while staged: the contiguous cache the steps read and write, and this
    call's new K/V, ``recent_k/v [B, k, K, D]``: index ``i`` holds position ``base[b] + i``
    (``base[b] >= NO_SLOT``: the row records nothing)."""

    working: LayerCache
    recent_k: Array
    recent_v: Array
    base: Array


@struct.dataclass
class StagedCache:
    """The model's cache while staged: per layer a contiguous cache and the recent K/V, and
    the rows' first position of the call (shared by every layer)."""

    working: tuple[LayerCache, ...]
    recent_k: tuple[Array, ...]
    recent_v: tuple[Array, ...]
    base: Array

    def layer(self, i: int) -> StagedLayer:
        return StagedLayer(self.working[i], self.recent_k[i], self.recent_v[i], self.base)


def stage(kernel: AttentionKernel, layer: PagedLayer, max_len: int) -> LayerCache:
    """``kernel``'s contiguous cache of ``max_len`` slots holding every row's table pages
    (a position without a page holds another page's values: nothing a query of the row may
    see, since the host gives an active row pages for every position it has written).

    A kernel whose layout can be gathered from the pool directly offers ``from_pages(k_pool,
    v_pool, table, max_len)`` (``xla_cpu``'s blocks: whole page rows, no transpose); the
    others get :func:`~jaxlab.kernels.paged.gather` then ``fill``. Every page is read, not
    only the ones some row has written yet: the cache is written whole either way."""
    from_pages = getattr(kernel, "from_pages", None)
    if from_pages is not None:
        cache = from_pages(layer.k, layer.v, layer.table, max_len)
        if cache is not None:
            return cache
    k, v = gather(layer)
    return kernel.fill(k[:, :max_len], v[:, :max_len], max_len)


def record(recent: Array, new: Array, start: Array, base: Array) -> Array:
    """``new [B, T, K, D]`` of positions ``start[b] + t`` into ``recent [B, k, K, D]`` at
    index ``start[b] + t - base[b]``; indices outside ``0 .. k - 1`` are dropped."""
    b, t = new.shape[:2]
    steps = recent.shape[1]
    at = (start - base).astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    at = jnp.where((at >= 0) & (at < steps), at, steps)  # out of range: dropped
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    return recent.at[rows, at].set(new.astype(recent.dtype), mode="drop", unique_indices=True)


class Staged:
    """The cache methods over a :class:`StagedLayer`: the contiguous ``kernel``'s, and each
    write also recorded in the layer's recent K/V."""

    def __init__(self, kernel: AttentionKernel) -> None:
        self.kernel = kernel
        self.name = f"staged_{kernel.name}"

    def write(self, cache: StagedLayer, k: Array, v: Array, start: Array) -> StagedLayer:
        return StagedLayer(
            self.kernel.write(cache.working, k, v, start),
            record(cache.recent_k, k, start, cache.base),
            record(cache.recent_v, v, start, cache.base),
            cache.base,
        )

    def attend_cache(self, q: Array, cache: StagedLayer, positions: Array) -> Array:
        return self.kernel.attend_cache(q, cache.working, positions)

    def take_rows(self, cache: StagedLayer, r: int) -> StagedLayer:
        return StagedLayer(
            self.kernel.take_rows(cache.working, r),
            cache.recent_k[:r],
            cache.recent_v[:r],
            cache.base[:r],
        )


__all__ = ["Staged", "StagedCache", "StagedLayer", "record", "stage"]
