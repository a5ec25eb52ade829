"""The blocked, kv-head-major cache the ``xla_cpu`` kernel decodes from.

Layout: per layer, ``k`` and ``v`` are tuples of **blocks** ``[B * K, block, D]`` that
together cover the cache's slots (:func:`cache_blocks`). Row ``b * K + j`` holds kv head
``j`` of slot-row ``b``; slot ``s`` lives in block ``s // block`` at offset ``s % block``.

Why this shape on XLA:CPU (figures in ``docs/performance.md``):

* **kv-head major.** The attention dots then have one batch dimension, ``n = b * K + j``,
  that is already the leading axis of the stored buffer: XLA:CPU reads the cache in place.
  Over the contiguous ``[B, S, K, D]`` layout it canonicalises the dot by transposing the
  whole cache first, every layer, every step.
* **One scatter per block for the write**, with unique sorted indices, whose result feeds
  the dots directly: XLA updates the donated buffer in place, with no copy.
* **Blocks as separate buffers.** A row at position ``p`` sees only slots ``<= p``, so a
  step reads only the leading blocks that some row can see (a ``lax.switch`` over the
  block count). A slice of one buffer would be a copy on XLA:CPU; a tuple of blocks is not.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.kernels.masks import MASK_VALUE
from jaxlab.kernels.reduce import softmax_last

Array = jax.Array

#: Caches at least this long are split into :data:`N_BLOCKS` blocks; shorter ones are one.
MIN_BLOCKED_LEN = 64
#: More blocks read less at long positions, but each is one more small dot per layer at
#: batch 1; four was the measured balance (docs/performance.md).
N_BLOCKS = 4


def cache_blocks(max_len: int) -> tuple[int, ...]:
    """Block sizes of a ``max_len`` cache: :data:`N_BLOCKS` near-equal blocks (multiples of 8
    but the last), or one block under :data:`MIN_BLOCKED_LEN` slots."""
    if max_len < MIN_BLOCKED_LEN:
        return (max_len,)
    size = -(-max_len // N_BLOCKS)
    size = -(-size // 8) * 8
    full, rest = divmod(max_len, size)
    return (size,) * full + ((rest,) if rest else ())


def block_starts(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """First slot of each block."""
    return tuple(itertools.accumulate(blocks[:-1], initial=0))


@struct.dataclass
class BlockedCache:
    """One layer's blocks (module docstring); ``n_kv`` is static."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    n_kv: int = struct.field(pytree_node=False)

    @property
    def rows(self) -> int:
        return self.k[0].shape[0] // self.n_kv

    @property
    def max_len(self) -> int:
        return sum(b.shape[1] for b in self.k)


def _split(rows: Array) -> tuple[Array, ...]:
    """``[N, max_len, D]`` -> its :func:`cache_blocks` along axis 1 (static slices)."""
    sizes = cache_blocks(rows.shape[1])
    return tuple(rows[:, at : at + n] for at, n in zip(block_starts(sizes), sizes, strict=True))


def _kv_major(a: Array) -> Array:
    """``[B, T, K, D]`` -> ``[B * K, T, D]``."""
    b, t, k, d = a.shape
    return jnp.transpose(a, (0, 2, 1, 3)).reshape(b * k, t, d)


def init(batch: int, max_len: int, n_kv: int, head_dim: int, dtype: DTypeLike) -> BlockedCache:
    def layer() -> tuple[Array, ...]:
        return tuple(jnp.zeros((batch * n_kv, n, head_dim), dtype) for n in cache_blocks(max_len))

    return BlockedCache(layer(), layer(), n_kv)


def fill(k: Array, v: Array, max_len: int) -> BlockedCache:
    """Prefill's ``[B, T, K, D]`` K/V as blocks over ``max_len`` slots: one transpose, zeros
    past ``T``, static slices."""
    if max_len < k.shape[1]:
        raise ValueError(f"max_len {max_len} is shorter than the prefill ({k.shape[1]} slots)")

    def f(a: Array) -> tuple[Array, ...]:
        return _split(jnp.pad(_kv_major(a), ((0, 0), (0, max_len - a.shape[1]), (0, 0))))

    return BlockedCache(f(k), f(v), k.shape[2])


def from_pages(k_pool: Array, v_pool: Array, table: Array, max_len: int) -> BlockedCache | None:
    """A cache of ``max_len`` slots holding each row's table pages, read straight from a
    kv-head-major pool ``[K, num_pages, page_size, D]`` (:mod:`jaxlab.kernels.paged`): each
    block is one gather of whole ``page_size x D`` rows, already in the block's
    ``[B * K, block, D]`` order, so nothing is transposed. None when a block does not
    start and end on page boundaries (the caller gathers and :func:`fill` s instead)."""
    n_kv, num_pages, ps, d = k_pool.shape
    b = table.shape[0]
    sizes = cache_blocks(max_len)
    if any(n % ps for n in sizes):
        return None
    pages = jnp.minimum(table, num_pages - 1)  # NO_PAGE: a position the row never shows
    heads = jnp.arange(n_kv, dtype=jnp.int32)[None, :, None] * num_pages

    def blocks(pool: Array) -> tuple[Array, ...]:
        flat = pool.reshape(n_kv * num_pages, ps * d)
        out = []
        for at, n in zip(block_starts(sizes), sizes, strict=True):
            rows = (heads + pages[:, None, at // ps : (at + n) // ps]).reshape(-1)  # (b, k, j)
            out.append(jnp.take(flat, rows, axis=0, mode="clip").reshape(b * n_kv, n, d))
        return tuple(out)

    return BlockedCache(blocks(k_pool), blocks(v_pool), n_kv)


def read(cache: BlockedCache, positions: Array) -> tuple[Array, Array]:
    """``(k, v) [B, T, K, D]`` at ``positions [B, T]`` (each below ``max_len``): a gather of
    ``T`` slots per row and kv head from each block, the block holding each position
    kept."""
    b, t = positions.shape
    n_kv = cache.n_kv
    sizes = tuple(x.shape[1] for x in cache.k)
    # Slot indices per row of the [B * K, block, D] blocks: (b, j) reads positions[b].
    pos = jnp.repeat(positions, n_kv, axis=0)  # [B * K, T]

    def one(blocks: tuple[Array, ...]) -> Array:
        out = jnp.zeros((b * n_kv, t, blocks[0].shape[2]), blocks[0].dtype)
        for at, n, blk in zip(block_starts(sizes), sizes, blocks, strict=True):
            inside = (pos >= at) & (pos < at + n)
            got = jnp.take_along_axis(blk, jnp.clip(pos - at, 0, n - 1)[:, :, None], axis=1)
            out = jnp.where(inside[:, :, None], got, out)
        return out.reshape(b, n_kv, t, -1).transpose(0, 2, 1, 3)

    return one(cache.k), one(cache.v)


def _write(blocks: tuple[Array, ...], new: Array, start: Array) -> tuple[Array, ...]:
    """``new [B, T, K, D]`` at slots ``start[b] + t``: one scatter per block. A slot in
    another block (or past the cache) gets an out-of-range index there, which
    ``mode="drop"`` skips. Indices run row by row, slots ascending: unique and sorted."""
    b, t, kv, d = new.shape
    rows = jnp.repeat(jnp.arange(b * kv), t)  # (b, j, t) order
    cols = jnp.repeat(start.astype(jnp.int32), kv * t) + jnp.tile(jnp.arange(t), b * kv)
    vals = _kv_major(new).reshape(b * kv * t, d)
    out = []
    for at, blk in zip(block_starts(tuple(x.shape[1] for x in blocks)), blocks, strict=True):
        n = blk.shape[1]
        local = jnp.where((cols >= at) & (cols < at + n), cols - at, n)
        out.append(
            blk.at[rows, local].set(
                vals.astype(blk.dtype), unique_indices=True, indices_are_sorted=True, mode="drop"
            )
        )
    return tuple(out)


def write(cache: BlockedCache, k: Array, v: Array, start: Array) -> BlockedCache:
    return BlockedCache(_write(cache.k, k, start), _write(cache.v, v, start), cache.n_kv)


def _attend_blocks(
    q: Array, k: tuple[Array, ...], v: tuple[Array, ...], visible: Array, n_kv: int
) -> Array:
    """``q [B, T, H, D]`` over blocks ``[B * K, block, D]``; ``visible bool[B, T, sum(block)]``.

    The queries of kv head ``j`` of row ``b`` form one ``[T * G, D]`` matrix against that
    row's ``[block, D]`` slab, so both dots read the stored blocks in place. Each block is
    its own dot; the logits are joined for one softmax.
    """
    b, t, h, d = q.shape
    g = h // n_kv
    n = b * n_kv
    qg = q.reshape(b, t, n_kv, g, d).transpose(0, 2, 1, 3, 4).reshape(n, t * g, d)
    parts = [
        jnp.einsum("nqd,nsd->nqs", qg, kb.astype(q.dtype), preferred_element_type=jnp.float32)
        for kb in k
    ]
    logits = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    logits = logits * (1.0 / math.sqrt(d))
    # visible [B, T, S] broadcasts over the kv heads and a group's query heads.
    s = logits.shape[-1]
    logits = logits.reshape(b, n_kv, t, g, s)
    logits = jnp.where(visible[:, None, :, None, :], logits, MASK_VALUE).reshape(n, t * g, s)
    probs = softmax_last(logits).astype(q.dtype)
    cuts = list(itertools.accumulate(vb.shape[1] for vb in v[:-1]))
    outs = [
        jnp.einsum("nqs,nsd->nqd", p, vb.astype(q.dtype))
        for p, vb in zip(jnp.split(probs, cuts, axis=-1), v, strict=True)
    ]
    out = functools.reduce(operator.add, outs)
    return out.reshape(b, n_kv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)


def attend(q: Array, cache: BlockedCache, positions: Array) -> Array:
    """``q [B, T, H, D]`` at ``positions [B, T]`` over the leading blocks that some query
    can see: the fewest that hold ``max(positions) + 1`` slots (a ``lax.switch`` over the
    count; slots past each query's position are masked in every branch, so the result
    equals attending over the whole cache)."""
    sizes = tuple(x.shape[1] for x in cache.k)
    ends = list(itertools.accumulate(sizes))
    slots = jnp.arange(ends[-1])

    def first(c: int) -> Callable[[Array, tuple[Array, ...], tuple[Array, ...], Array], Array]:
        def attend_c(q: Array, k: tuple[Array, ...], v: tuple[Array, ...], pos: Array) -> Array:
            visible = slots[None, None, : ends[c - 1]] <= pos[:, :, None]
            return _attend_blocks(q, k[:c], v[:c], visible, cache.n_kv)

        return attend_c

    if len(sizes) == 1:
        return first(1)(q, cache.k, cache.v, positions)
    need = jnp.max(positions) + 1
    index = jnp.sum(jnp.asarray(ends[:-1]) < need)
    branches = [first(c) for c in range(1, len(sizes) + 1)]
    return jax.lax.switch(index, branches, q, cache.k, cache.v, positions)


def insert(cache: BlockedCache, rows: BlockedCache, slots: Array) -> BlockedCache:
    """Rows of slot ``s`` are ``s * K .. s * K + K - 1``; a skipped row's stay out of range."""
    kv = cache.n_kv
    idx = jnp.where(slots >= 0, slots, cache.rows)
    flat = (idx[:, None] * kv + jnp.arange(kv, dtype=idx.dtype)[None, :]).reshape(-1)

    def put(big: Array, new: Array) -> Array:
        return big.at[flat].set(new.astype(big.dtype), mode="drop")

    return BlockedCache(
        tuple(map(put, cache.k, rows.k)), tuple(map(put, cache.v, rows.v)), cache.n_kv
    )


def take_rows(cache: BlockedCache, r: int) -> BlockedCache:
    """The leading ``r`` rows: a small copy of each block's first ``r * K`` rows."""
    if r == cache.rows:
        return cache
    n = r * cache.n_kv
    return BlockedCache(tuple(b[:n] for b in cache.k), tuple(b[:n] for b in cache.v), cache.n_kv)


def to_bskd(cache: BlockedCache) -> tuple[Array, Array]:
    def f(blocks: tuple[Array, ...]) -> Array:
        a = jnp.concatenate(blocks, axis=1)
        n, s, d = a.shape
        return jnp.transpose(a.reshape(n // cache.n_kv, cache.n_kv, s, d), (0, 2, 1, 3))

    return f(cache.k), f(cache.v)


__all__ = [
    "MIN_BLOCKED_LEN",
    "N_BLOCKS",
    "BlockedCache",
    "attend",
    "block_starts",
    "cache_blocks",
    "fill",
    "from_pages",
    "init",
    "insert",
    "read",
    "take_rows",
    "to_bskd",
    "write",
]
