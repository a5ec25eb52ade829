"""The one interface every attention kernel implements.

Shapes (letters used throughout ``jaxlab.kernels``)::

    B batch (cache rows, "slots")   T query length   S key/value length (cache slots)
    H query heads   K key/value heads   G = H // K query heads per kv head   D head_dim

A kernel owns two things: the math of attention, and the layout of the decode cache it
reads. The model calls only these methods, so swapping a kernel changes neither the model
nor the engine; every kernel is tested against :mod:`jaxlab.kernels.reference`.

Precision policy, the same in every kernel: K/V are cast to the query dtype, logits and
softmax are float32, the probabilities are cast to the value dtype for the second matmul,
and the output is in the query dtype. Scale is ``1/sqrt(D)``. Query head ``h`` reads kv
head ``h // G``.

Cache contract: a layer's cache is a pytree in the kernel's own layout (one per layer).
Slot ``s`` of row ``b`` holds the (RoPE-rotated) key/value of the token at position ``s``;
a query at position ``p`` sees slots ``<= p`` (:func:`jaxlab.kernels.masks.cache_mask`).
Writes to slots ``>= S`` are dropped, which is how a caller skips a row.

A paged cache (:mod:`jaxlab.kernels.paged`) keeps the same contract through a page table:
position ``p`` of row ``b`` lives in page ``table[b, p // page_size]``. Its kernels
implement :class:`PagedKernel`, the cached half of this interface over a
:class:`~jaxlab.kernels.paged.PagedLayer`; each contiguous kernel names its paged
counterpart (:data:`jaxlab.kernels.PAGED_FOR`).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from jax.typing import DTypeLike

Array = jax.Array
#: One layer's decode cache, in the layout of the kernel that made it.
LayerCache = Any

#: A start slot past any cache: a write there is dropped (how a caller skips a row).
NO_SLOT = 2**30


class AttentionKernel(Protocol):
    """Attention math plus the decode-cache layout it reads (module docstring)."""

    name: str

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        """Causal self-attention over a sequence (training, prefill): ``q [B, T, H, D]``,
        ``k, v [B, T, K, D]``; a query sees keys at or before it, and with ``segment_ids
        [B, T]`` only those of its own segment (packed documents). -> ``[B, T, H, D]``."""
        ...

    def init_cache(
        self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> LayerCache:
        """An all-zero cache of ``batch`` rows and ``max_len`` slots (traceable)."""
        ...

    def fill(self, k: Array, v: Array, max_len: int) -> LayerCache:
        """A new cache holding ``k, v [B, T, K, D]`` in slots ``0 .. T-1`` (prefill), zeros
        after them, ``max_len >= T`` slots in all."""
        ...

    def write(self, cache: LayerCache, k: Array, v: Array, start: Array) -> LayerCache:
        """``k, v [B, T, K, D]`` written at slots ``start[b] .. start[b] + T - 1`` of each row;
        slots past the cache are dropped. In place when the cache is donated."""
        ...

    def attend_cache(self, q: Array, cache: LayerCache, positions: Array) -> Array:
        """``q [B, T, H, D]`` at ``positions [B, T]`` over the cache's slots ``<= position``
        (the cache holds ``B`` rows) -> ``[B, T, H, D]``."""
        ...

    def insert(self, cache: LayerCache, rows: LayerCache, slots: Array) -> LayerCache:
        """Row ``i`` of ``rows`` (a cache of ``R`` rows, same slots) copied into row
        ``slots[i]`` of ``cache``; a negative entry skips its row. Slots are distinct."""
        ...

    def take_rows(self, cache: LayerCache, r: int) -> LayerCache:
        """The cache of the leading ``r`` rows (a view where the layout allows one)."""
        ...

    def to_bskd(self, cache: LayerCache) -> tuple[Array, Array]:
        """``(k, v)`` as ``[B, S, K, D]`` arrays, whatever the layout (tests, inspection)."""
        ...


class PagedKernel(Protocol):
    """Attention over a paged cache: the cache methods of :class:`AttentionKernel`, with a
    :class:`~jaxlab.kernels.paged.PagedLayer` (one layer's pool + the page table) for the
    cache. Positions without a page are dropped on write and invisible on read."""

    name: str

    def init_pool(
        self, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> Any:
        """An all-zero pool of ``num_pages`` pages (traceable)."""
        ...

    def write(self, cache: Any, k: Array, v: Array, start: Array) -> Any:
        """``k, v [B, T, K, D]`` at positions ``start[b] ..`` through each row's table."""
        ...

    def write_at(self, cache: Any, k: Array, v: Array, positions: Array) -> Any:
        """``k, v [B, T, K, D]`` at ``positions [B, T]`` (``>= NO_SLOT``: dropped)."""
        ...

    def read_at(self, cache: Any, positions: Array) -> tuple[Array, Array]:
        """``(k, v) [B, T, K, D]`` at ``positions [B, T]`` through each row's table."""
        ...

    def attend_cache(self, q: Array, cache: Any, positions: Array) -> Array:
        """``q [B, T, H, D]`` at ``positions [B, T]`` over each row's pages."""
        ...

    def take_rows(self, cache: Any, r: int) -> Any:
        """The view of the leading ``r`` rows (their table rows; the pool is shared)."""
        ...

    def to_bskd(self, cache: Any) -> tuple[Array, Array]:
        """Every row's table pages as contiguous ``[B, max_pages * page_size, K, D]``."""
        ...


__all__ = ["NO_SLOT", "AttentionKernel", "LayerCache", "PagedKernel"]
