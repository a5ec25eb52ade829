"""The paged KV cache: a pool of fixed-size pages per layer, a page table per row, and the
``paged_reference`` kernel (the spec the fast paged kernel is tested against).

A contiguous cache gives every row ``max_len`` slots whether it uses them or not. A paged
cache gives each layer one **pool** of ``num_pages`` pages of ``page_size`` token slots,
and each row a **page table**: row ``b``'s token at position ``p`` lives in page
``table[b, p // page_size]`` at offset ``p % page_size``. Rows hold only the pages they
need, a page freed by one request is reused by the next, and two requests may read the
same page (a shared prompt prefix). Which row owns which page is the host's business
(:class:`jaxlab.infer.pages.PagePool`); a kernel only follows the table.

Terms and invariants, shared by every paged kernel:

* Page ids are ``0 .. num_pages - 1``; ``NO_PAGE = num_pages`` marks a table entry with no
  page. A write through it is dropped (``mode="drop"``), a read through it is clipped to
  a real page and masked: it is never visible.
* The table is one ``int32[B, max_pages]`` array shared by every layer
  (``max_pages = ceil(max_len / page_size)``); :class:`Pages` holds it beside the pools.
  A kernel sees one layer through :class:`PagedLayer` (that layer's pool and the table).
* Visibility is the contiguous cache's, through the table: a query at position ``p``
  sees the slots of positions ``<= p`` whose page is present
  (:func:`visible_slots`).
* Writes to positions ``>= NO_SLOT`` (or past ``max_pages`` pages) are dropped, which is
  how a caller skips a row, as with a contiguous cache.

The pool's layout is kv-head major, ``[K, num_pages, page_size, D]`` per layer, for
``paged_reference`` and ``paged_xla``: one kv head's page is then a contiguous ``page_size x
D`` slab, so ``paged_xla`` gathers a row's pages as whole rows of a 2-D view and feeds them
to its dots without a transpose (:mod:`jaxlab.kernels.paged_xla` says why that matters on
XLA:CPU). ``paged_pallas`` keeps its float pools lane-dense, ``[num_pages, page_size, K *
D]`` (:mod:`jaxlab.kernels.paged_dense` says why); :attr:`PagedCache.dense_heads` tells
the two apart, and every function here takes the kv-head-major one.

**An int8 pool** (``inference.kv_cache_dtype = "int8"``) stores K and V as int8 and, beside
them, one float32 scale per token and kv head (``k_scale, v_scale [K, num_pages,
page_size]``): each written ``[D]`` vector is quantized symmetrically on its own
(:mod:`jaxlab.kernels.int8`), when it is written. Readers either dequantize (the reference)
or apply the scales to the attention logits and probabilities (``paged_xla``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.kernels import int8
from jaxlab.kernels.masks import cache_mask
from jaxlab.kernels.reference import attention

Array = jax.Array


#: Bytes of the scale an int8 pool keeps per token and kv head, for K and for V each.
KV_SCALE_BYTES = 4


@struct.dataclass
class PagedCache:
    """One layer's pool: ``k, v [K, num_pages, page_size, D]``; an int8 pool also holds
    ``k_scale, v_scale f32[K, num_pages, page_size]`` (None otherwise). With
    ``dense_heads = K`` the pool is lane-dense instead, ``k, v [num_pages, page_size, K * D]``
    (:mod:`jaxlab.kernels.paged_dense`)."""

    k: Array
    v: Array
    k_scale: Array | None = None
    v_scale: Array | None = None
    dense_heads: int | None = struct.field(pytree_node=False, default=None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0 if self.dense_heads else 1]

    @property
    def page_size(self) -> int:
        return self.k.shape[1 if self.dense_heads else 2]


@struct.dataclass
class PagedLayer:
    """What a paged kernel reads and writes: one layer's pool (with its scales, if int8)
    and the shared page table ``table i32[B, max_pages]`` (entries are page ids or
    ``NO_PAGE = num_pages``)."""

    k: Array
    v: Array
    table: Array
    k_scale: Array | None = None
    v_scale: Array | None = None
    dense_heads: int | None = struct.field(pytree_node=False, default=None)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0 if self.dense_heads else 1]

    @property
    def page_size(self) -> int:
        return self.k.shape[1 if self.dense_heads else 2]

    @property
    def quantized(self) -> bool:
        """An int8 pool: values are read as ``value * scale``."""
        return self.k_scale is not None

    @property
    def pool(self) -> PagedCache:
        return PagedCache(self.k, self.v, self.k_scale, self.v_scale, self.dense_heads)


@struct.dataclass
class Pages:
    """The model's paged cache: one pool per layer, and the page table all layers share.

    A prefix (what the engine's prefill hands to ``insert``) is a ``Pages`` with no pools:
    only the table rows of its sequences.
    """

    pools: tuple[PagedCache, ...]
    table: Array

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    @property
    def num_pages(self) -> int:
        return self.pools[0].num_pages

    def layer(self, i: int) -> PagedLayer:
        pool = self.pools[i]
        return PagedLayer(pool.k, pool.v, self.table, pool.k_scale, pool.v_scale, pool.dense_heads)


#: The fewest positions read: shorter page counts would add branches for little saving.
MIN_VISIBLE_TOKENS = 64


def page_buckets(max_pages: int, page_size: int) -> tuple[int, ...]:
    """The page counts a table is read in (a ``lax.switch`` picks the smallest that holds
    every position some row can see): powers of two from ``MIN_VISIBLE_TOKENS`` worth of
    pages up to half the table, then quarters of it (``(4, 8, 12, 16)`` for 16 pages of
    16 tokens, ``(4, 8, 16, 32, 48, 64)`` for 64). Every page read is a copy on XLA:CPU (a
    gather), so the long tail, where most steps of a long request fall, is cut finer than
    powers of two would."""
    smallest = max(1, -(-MIN_VISIBLE_TOKENS // page_size))
    if smallest >= max_pages:
        return (max_pages,)
    out: list[int] = []
    n = smallest
    while n < max_pages / 2:
        out.append(n)
        n *= 2
    quarter = max(1, max_pages // 4)
    n = max(n, -(-max_pages // 2))
    while n < max_pages:
        out.append(n)
        n += quarter
    return (*sorted(set(out)), max_pages)


def max_pages_for(max_len: int, page_size: int) -> int:
    """Table width: the pages one sequence of ``max_len`` tokens may hold."""
    return math.ceil(max_len / page_size)


def init_pool(
    num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
) -> PagedCache:
    """An all-zero pool (traceable); ``dtype`` int8 gives an int8 pool with its scales."""
    shape = (n_kv_heads, num_pages, page_size, head_dim)
    if jnp.dtype(dtype) == jnp.int8:
        scales = shape[:-1]
        return PagedCache(
            jnp.zeros(shape, jnp.int8),
            jnp.zeros(shape, jnp.int8),
            jnp.zeros(scales, jnp.float32),
            jnp.zeros(scales, jnp.float32),
        )
    return PagedCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def no_pages(rows: int, max_pages: int, num_pages: int) -> Array:
    """A table of ``rows`` rows holding no page (every entry ``NO_PAGE``)."""
    return jnp.full((rows, max_pages), num_pages, jnp.int32)


def token_slots(table: Array, positions: Array, num_pages: int, page_size: int) -> Array:
    """``i32[B, T]``: the flat pool slot (``page * page_size + offset``) of the token at
    ``positions [B, T]``; a token whose page is ``NO_PAGE``, or past the table, or at a
    position ``>= NO_SLOT``, gets a slot past the pool, distinct per token (so a scatter
    can still promise unique indices) and dropped by ``mode="drop"``."""
    b, t = positions.shape
    n_slots = num_pages * page_size
    page_index = positions // page_size
    in_table = (positions >= 0) & (page_index < table.shape[1])
    page = jnp.take_along_axis(table, jnp.clip(page_index, 0, table.shape[1] - 1), axis=1)
    real = in_table & (page < num_pages)
    slot = page * page_size + positions % page_size
    past = n_slots + jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
    return jnp.where(real, slot, past).astype(jnp.int32)


def run_positions(start: Array, t: int) -> Array:
    """``i32[B, T]``: positions ``start[b] .. start[b] + t - 1`` of each row."""
    return start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def write(layer: PagedLayer, k: Array, v: Array, start: Array) -> PagedLayer:
    """``k, v [B, T, K, D]`` of the tokens at positions ``start[b] .. start[b] + T - 1``
    written through the table (:func:`write_at`)."""
    return write_at(layer, k, v, run_positions(start, k.shape[1]))


def write_at(layer: PagedLayer, k: Array, v: Array, positions: Array) -> PagedLayer:
    """``k, v [B, T, K, D]`` of the tokens at ``positions [B, T]``, written through the table:
    one scatter per buffer into the flattened pages. Positions without a page, or ``>=
    NO_SLOT``, are dropped. In place when the pool is donated; indices are unique as long
    as no page is written by two rows (the host never lends a page writable twice)."""
    b, t, n_kv, d = k.shape
    slots = token_slots(layer.table, positions, layer.num_pages, layer.page_size).reshape(-1)
    n_slots = layer.num_pages * layer.page_size
    total = n_kv * n_slots
    # One [D] row per (kv head, token) of the [K * num_pages * page_size, D] view; a
    # dropped token gets a distinct index past the whole pool. One more, always dropped,
    # keeps the update count >= 2: XLA turns a scatter of one update into a
    # dynamic-update-slice, whose "drop" select keeps the old buffer alive, a copy of the
    # whole pool per layer per step.
    head = jnp.arange(n_kv, dtype=jnp.int32)[:, None]
    past = total + head * (b * t) + jnp.arange(b * t, dtype=jnp.int32)[None, :]
    idx = jnp.where(slots[None, :] < n_slots, head * n_slots + slots[None, :], past).reshape(-1)
    idx = jnp.concatenate([idx, jnp.full((1,), total + n_kv * b * t, jnp.int32)])

    def scatter(pool: Array, rows: Array) -> Array:
        flat = pool.reshape(total, *pool.shape[3:])
        return flat.at[idx].set(rows, mode="drop", unique_indices=True).reshape(pool.shape)

    def put(pool: Array, scales: Array | None, new: Array) -> tuple[Array, Array | None]:
        rows = new.reshape(b * t, n_kv, d).transpose(1, 0, 2).reshape(n_kv * b * t, d)
        rows = jnp.concatenate([rows, jnp.zeros((1, d), rows.dtype)])
        if scales is None:
            return scatter(pool, rows.astype(pool.dtype)), None
        q, scale = int8.quantize(rows, axis=-1)  # one scale per (kv head, token)
        return scatter(pool, q), scatter(scales, scale)

    k_pool, k_scale = put(layer.k, layer.k_scale, k)
    v_pool, v_scale = put(layer.v, layer.v_scale, v)
    return PagedLayer(k_pool, v_pool, layer.table, k_scale, v_scale)


def present_slots(table: Array, num_pages: int, page_size: int) -> Array:
    """``bool[B, max_pages * page_size]``: the slot's page is a real page (not NO_PAGE)."""
    return jnp.repeat(table < num_pages, page_size, axis=1)


def visible_slots(positions: Array, table: Array, num_pages: int, page_size: int) -> Array:
    """``bool[B, T, S]`` over the leading ``S = table.shape[1] * page_size`` positions: a
    query at ``positions[b, t]`` sees position ``s`` iff ``s <= positions[b, t]`` and
    ``s``'s page is present."""
    present = present_slots(table, num_pages, page_size)
    return cache_mask(positions, present.shape[1])[:, 0] & present[:, None, :]


def gather(layer: PagedLayer) -> tuple[Array, Array]:
    """``(k, v)`` of every table page of every row (a kv-head-major pool), contiguous:
    ``[B, max_pages * page_size, K, D]``, position ``s`` at slot ``s`` (``NO_PAGE`` entries
    read the last page: mask them with :func:`present_slots`). An int8 pool is dequantized
    (float32)."""
    b, n = layer.table.shape
    ps = layer.page_size

    def one(pool: Array, scale: Array | None) -> Array:
        pages = jnp.take(pool, layer.table, axis=1, mode="clip")  # [K, B, n, ps, D]
        if scale is not None:
            scales = jnp.take(scale, layer.table, axis=1, mode="clip")  # [K, B, n, ps]
            pages = int8.dequantize(pages, scales, axis=-1)
        return pages.transpose(1, 2, 3, 0, 4).reshape(b, n * ps, pool.shape[0], pool.shape[3])

    return one(layer.k, layer.k_scale), one(layer.v, layer.v_scale)


def take_rows(layer: PagedLayer, r: int) -> PagedLayer:
    """The leading ``r`` rows: the pool is not row-indexed, so only the table is sliced."""
    if r == layer.table.shape[0]:
        return layer
    return dataclasses.replace(layer, table=layer.table[:r])


def read_at(layer: PagedLayer, positions: Array) -> tuple[Array, Array]:
    """``(k, v) [B, T, K, D]`` at ``positions [B, T]`` through the table, what :func:`write_at`
    would put back (a position without a page reads some real page's values: a caller
    writing them back there has them dropped again)."""
    n_kv, num_pages, ps, d = layer.k.shape
    slots = token_slots(layer.table, positions, num_pages, ps)
    slots = jnp.minimum(slots, num_pages * ps - 1)

    def one(pool: Array) -> Array:
        got = jnp.take(pool.reshape(n_kv, num_pages * ps, d), slots, axis=1)  # [K, B, T, D]
        return got.transpose(1, 2, 0, 3)

    return one(layer.k), one(layer.v)


class PagedLayout:
    """The cache methods every paged kernel shares (pool, write, rows, inspection)."""

    def init_pool(
        self, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: DTypeLike
    ) -> PagedCache:
        return init_pool(num_pages, page_size, n_kv_heads, head_dim, dtype)

    def write(self, cache: PagedLayer, k: Array, v: Array, start: Array) -> PagedLayer:
        # Through the kernel's own write_at, whatever layout that writes.
        return self.write_at(cache, k, v, run_positions(start, k.shape[1]))

    def write_at(self, cache: PagedLayer, k: Array, v: Array, positions: Array) -> PagedLayer:
        return write_at(cache, k, v, positions)

    def take_rows(self, cache: PagedLayer, r: int) -> PagedLayer:
        return take_rows(cache, r)

    def read_at(self, cache: PagedLayer, positions: Array) -> tuple[Array, Array]:
        return read_at(cache, positions)

    def to_bskd(self, cache: PagedLayer) -> tuple[Array, Array]:
        return gather(cache)


class PagedReference(PagedLayout):
    """The spec: gather every table page into a contiguous cache, mask what the contiguous
    cache would mask plus the missing pages, and run the reference kernel's attention."""

    name = "paged_reference"

    def attend_cache(self, q: Array, cache: PagedLayer, positions: Array) -> Array:
        k, v = gather(cache)
        mask = visible_slots(positions, cache.table, cache.num_pages, cache.page_size)
        return attention(q, k, v, mask[:, None])


__all__ = [
    "KV_SCALE_BYTES",
    "MIN_VISIBLE_TOKENS",
    "PagedCache",
    "PagedLayer",
    "PagedLayout",
    "PagedReference",
    "Pages",
    "gather",
    "init_pool",
    "max_pages_for",
    "no_pages",
    "page_buckets",
    "present_slots",
    "read_at",
    "run_positions",
    "take_rows",
    "token_slots",
    "visible_slots",
    "write",
    "write_at",
]
