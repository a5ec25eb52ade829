"""Pages staged into a contiguous cache for the length of one decode call (XLA:CPU).

XLA:CPU reads a buffer in place only when a dot takes the whole buffer; every other read is
a copy first. So the paged kernels copy the pages a step reads (a gather) before their dots,
every layer, every step, where a contiguous cache is read in place: at full length a row's
K/V is ``2 x n_layers x max_len x n_kv_heads x head_dim`` floats, so with a dozen rows the
copy can be as large as the weights the step reads (``docs/inference.md`` works it out for
bench-small). Staging pays it once per decode call instead:

1. the call gathers each row's pages into the contiguous kernel's own cache (:func:`stage`);
2. its steps are the contiguous cache's decode steps, unchanged: they read that cache in
   place and write their new K/V into it; the pool is not touched;
3. after the last step, the positions the call wrote are read back out of the contiguous
   cache (:func:`written`) and written through the page table in one scatter per buffer,
   and the contiguous cache is dropped.

Between calls the decode state holds pages only; while a call runs it also holds a
contiguous cache of its rows. Every row is staged, busy or not: a ``lax.switch`` over row
counts around the whole loop, staging only the rows up to the last busy one, measured
slower for a full batch than the copy it saves.

**How long a cache is staged.** Not ``max_len``: the host knows the table, so it knows the
last table column that names a page in any row, and the call stages only up to it,
rounded up to a page bucket (:func:`stage_lengths`, :func:`stage_length`; the decode
state carries it as ``DecodeState.span``). Every position a row has written or will write
in the call has a page (the host's promise to ``set_table``), so it lies inside that
length; the positions past it lie in every row's future. The length is a shape, so each
one is its own compile, a few per decode chunk size. Why: the staged cache is the call's
largest buffer, and XLA:CPU maps each call's temporary buffers afresh, so every byte of it
is a page fault and a zeroed page before it is a copy; 64 rows of bench-small at
``max_len`` 256 are 128 MiB a call, while the requests of a short chat hold a quarter of
that.

A contiguous kernel may offer two shortcuts, used when present: ``from_pages(k_pool,
v_pool, table, max_len)`` builds its cache straight from the pool (None: not for this
shape), and ``read(cache, positions)`` reads a few positions back without converting the
whole cache. Which platforms stage is a tuning choice
(:attr:`jaxlab.runtime.tuning.Tuning.staged_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlab.kernels.base import NO_SLOT, AttentionKernel, LayerCache
from jaxlab.kernels.paged import PagedLayer, gather, page_buckets

Array = jax.Array


def stage_lengths(max_len: int, page_size: int, max_pages: int) -> tuple[int, ...]:
    """The lengths a staged call may stage, shortest first: the page counts of
    :func:`~jaxlab.kernels.paged.page_buckets` in tokens, the last one ``max_len``."""
    return tuple(min(n * page_size, max_len) for n in page_buckets(max_pages, page_size))


def stage_length(
    table: np.ndarray, num_pages: int, page_size: int, lengths: tuple[int, ...]
) -> int:
    """The shortest of ``lengths`` (:func:`stage_lengths`) holding every page that the host
    ``table`` ``i32[B, max_pages]`` names (``num_pages``: no page), in any row."""
    columns = np.flatnonzero((np.asarray(table) < num_pages).any(axis=0))
    need = 0 if columns.size == 0 else (int(columns[-1]) + 1) * page_size
    return next((n for n in lengths if n >= need), lengths[-1])


def stage(kernel: AttentionKernel, layer: PagedLayer, max_len: int) -> LayerCache:
    """``kernel``'s contiguous cache of ``max_len`` slots holding every row's table pages
    (a position without a page holds another page's values: nothing a query of the row may
    see, since the host gives an active row pages for every position it has written).

    Every page is read, not only the ones some row has written yet: the cache is written
    whole either way (zeros past the pages read), and a ``lax.switch`` over page counts
    would copy its zeros out of the branch.

    An int8 pool is not staged: the contiguous cache holds floats, so the tokens a call
    writes would be read unquantized until the call ends, and a request's output would
    depend on how its decoding is chunked. The engine reads int8 pools page by page."""
    if layer.quantized:
        raise ValueError(
            "an int8 KV pool (inference.kv_cache_dtype = 'int8') is read page by page by its"
            " paged kernel, not staged into a contiguous cache"
        )
    from_pages = getattr(kernel, "from_pages", None)
    if from_pages is not None:
        cache = from_pages(layer.k, layer.v, layer.table, max_len)
        if cache is not None:
            return cache
    k, v = gather(layer)
    return kernel.fill(k[:, :max_len], v[:, :max_len], max_len)


def read(kernel: AttentionKernel, cache: LayerCache, positions: Array) -> tuple[Array, Array]:
    """``(k, v) [B, T, K, D]`` at ``positions [B, T]`` (in range) of a contiguous cache."""
    reader = getattr(kernel, "read", None)
    if reader is not None:
        return reader(cache, positions)
    k, v = kernel.to_bskd(cache)
    at = positions[:, :, None, None]
    return jnp.take_along_axis(k, at, axis=1), jnp.take_along_axis(v, at, axis=1)


def written(
    kernel: AttentionKernel, cache: LayerCache, start: Array, end: Array, steps: int
) -> tuple[Array, Array, Array]:
    """What a staged call wrote, to put into the pages (:func:`~jaxlab.kernels.paged.write_at`):
    ``(k, v [B, steps, K, D], positions [B, steps])`` for positions ``start[b] .. end[b] -
    1`` of ``cache``, the others ``NO_SLOT`` (dropped); ``start >= NO_SLOT``: the row wrote
    nothing."""
    positions = start[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    wrote = (start[:, None] < NO_SLOT) & (positions < end[:, None])
    k, v = read(kernel, cache, jnp.where(wrote, positions, 0))
    return k, v, jnp.where(wrote, positions, NO_SLOT)


__all__ = ["read", "stage", "stage_length", "stage_lengths", "written"]
