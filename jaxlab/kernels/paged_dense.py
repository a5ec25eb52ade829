"""The lane-dense paged pool: one layer's pages as ``[num_pages, page_size, K * D]``, the
layout of ``paged_pallas``'s float pools, and the cache operations on it.

Why a second layout. A TPU keeps an array in HBM as tiles over its two minor dimensions,
``(sublanes, 128 lanes)`` (``(16, 128)`` for bf16). The kv-head-major pool of
:mod:`jaxlab.kernels.paged` has minor dimensions ``(page_size, D)``; with ``D = 64`` (the
``tpu-small`` preset) every tile is half padding, so each K/V byte a decode step reads or
writes moves two. Here the minor dimensions are ``(page_size, K * D)``: 768 lanes for
twelve heads of 64, six whole lane tiles, nothing padded. A page of every kv head is also
one contiguous block, one copy for the Pallas kernels
(:mod:`jaxlab.kernels.pallas_paged`, :mod:`jaxlab.kernels.pallas_paged_write`), where the
other layout needs a strided one.

Token ``p`` of a row lives at ``pool[table[b, p // page_size], p % page_size]``, the ``K * D``
values of its kv heads in head order: the same bytes as ``[num_pages, page_size, K, D]``.
Table, ``NO_PAGE`` and ``NO_SLOT`` rules are :mod:`jaxlab.kernels.paged`'s, and each
operation here equals its kv-head-major twin there after :func:`to_head_major` (tested in
``tests/kernels/test_paged_dense.py``). int8 pools stay kv-head major: their per-token
scales and their reader (``paged_xla``) are that layout's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jaxlab.kernels import paged as pg
from jaxlab.kernels.paged import PagedCache, PagedLayer, PagedLayout

Array = jax.Array


def init_pool(
    num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
) -> PagedCache:
    """An all-zero lane-dense pool (traceable); float ``dtype`` only (module docstring)."""
    if jnp.dtype(dtype) == jnp.int8:
        raise ValueError("paged_dense: int8 pools are kv-head major (paged.init_pool)")
    shape = (num_pages, page_size, n_kv_heads * head_dim)
    return PagedCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), dense_heads=n_kv_heads)


def from_head_major(layer: PagedLayer) -> PagedLayer:
    """The same pages, lane-dense (a float pool)."""
    if layer.dense_heads is not None:
        return layer
    if layer.quantized:
        raise ValueError("paged_dense: an int8 pool has no lane-dense form")
    n_kv, num_pages, ps, d = layer.k.shape

    def one(pool: Array) -> Array:
        return pool.transpose(1, 2, 0, 3).reshape(num_pages, ps, n_kv * d)

    return PagedLayer(one(layer.k), one(layer.v), layer.table, dense_heads=n_kv)


def to_head_major(layer: PagedLayer) -> PagedLayer:
    """The same pages, kv-head major: what :mod:`jaxlab.kernels.paged`'s functions take."""
    n_kv = layer.dense_heads
    if n_kv is None:
        return layer
    num_pages, ps, kd = layer.k.shape

    def one(pool: Array) -> Array:
        return pool.reshape(num_pages, ps, n_kv, kd // n_kv).transpose(2, 0, 1, 3)

    return PagedLayer(one(layer.k), one(layer.v), layer.table)


def write_at(layer: PagedLayer, k: Array, v: Array, positions: Array) -> PagedLayer:
    """``k, v [B, T, K, D]`` at ``positions [B, T]`` written through the table: one scatter
    per buffer of whole ``[K * D]`` token rows into the ``[num_pages * page_size, K * D]``
    view (:func:`jaxlab.kernels.paged.write_at` gives the rules, and why one more update
    that is always dropped)."""
    b, t = k.shape[:2]
    num_pages, ps, kd = layer.k.shape
    n_slots = num_pages * ps
    slots = pg.token_slots(layer.table, positions, num_pages, ps).reshape(-1)
    idx = jnp.concatenate([slots, jnp.full((1,), n_slots + b * t, jnp.int32)])

    def put(pool: Array, new: Array) -> Array:
        rows = jnp.concatenate([new.reshape(b * t, kd), jnp.zeros((1, kd), new.dtype)])
        flat = pool.reshape(n_slots, kd)
        flat = flat.at[idx].set(rows.astype(pool.dtype), mode="drop", unique_indices=True)
        return flat.reshape(pool.shape)

    return dataclasses.replace(layer, k=put(layer.k, k), v=put(layer.v, v))


def read_at(layer: PagedLayer, positions: Array) -> tuple[Array, Array]:
    """``(k, v) [B, T, K, D]`` at ``positions [B, T]`` through the table, as
    :func:`jaxlab.kernels.paged.read_at` reads them."""
    num_pages, ps, kd = layer.k.shape
    n_kv = layer.dense_heads or 1
    b, t = positions.shape
    slots = pg.token_slots(layer.table, positions, num_pages, ps)
    slots = jnp.minimum(slots, num_pages * ps - 1)

    def one(pool: Array) -> Array:
        got = jnp.take(pool.reshape(num_pages * ps, kd), slots.reshape(-1), axis=0)
        return got.reshape(b, t, n_kv, kd // n_kv)

    return one(layer.k), one(layer.v)


def gather_pages(pool: Array, table: Array, n_kv: int) -> Array:
    """``[B, n * page_size, K, D]``: the first ``n = table.shape[1]`` table pages of every
    row, contiguous (``NO_PAGE`` entries read the last page: mask them)."""
    b, n = table.shape
    ps, kd = pool.shape[1:]
    pages = jnp.take(pool, table.reshape(-1), axis=0, mode="clip")  # [B * n, ps, K * D]
    return pages.reshape(b, n * ps, n_kv, kd // n_kv)


def gather(layer: PagedLayer) -> tuple[Array, Array]:
    """:func:`jaxlab.kernels.paged.gather` of a lane-dense pool."""
    n_kv = layer.dense_heads or 1
    return gather_pages(layer.k, layer.table, n_kv), gather_pages(layer.v, layer.table, n_kv)


class PagedDenseLayout(PagedLayout):
    """Cache methods for a kernel whose float pools are lane-dense (int8 pools, and pools
    made by another kernel, keep :class:`~jaxlab.kernels.paged.PagedLayout`'s)."""

    def init_pool(
        self, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> PagedCache:
        if jnp.dtype(dtype) == jnp.int8:
            return super().init_pool(num_pages, page_size, n_kv_heads, head_dim, dtype)
        return init_pool(num_pages, page_size, n_kv_heads, head_dim, dtype)

    def write_at(self, cache: PagedLayer, k: Array, v: Array, positions: Array) -> PagedLayer:
        if cache.dense_heads is None:
            return super().write_at(cache, k, v, positions)
        return write_at(cache, k, v, positions)

    def read_at(self, cache: PagedLayer, positions: Array) -> tuple[Array, Array]:
        if cache.dense_heads is None:
            return super().read_at(cache, positions)
        return read_at(cache, positions)

    def to_bskd(self, cache: PagedLayer) -> tuple[Array, Array]:
        if cache.dense_heads is None:
            return super().to_bskd(cache)
        return gather(cache)


__all__ = [
    "PagedDenseLayout",
    "from_head_major",
    "gather",
    "gather_pages",
    "init_pool",
    "read_at",
    "to_head_major",
    "write_at",
]
