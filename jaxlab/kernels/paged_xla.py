"""The ``paged_xla`` kernel: attention over only the pages some query can see.

The paged counterpart of every kernel but the reference (:data:`jaxlab.kernels.PAGED_FOR`).
Two choices, both measured on XLA:CPU (``docs/performance.md``) and tested against
:class:`~jaxlab.kernels.paged.PagedReference`:

* **The visible pages only.** A decode step is bound by the bytes it reads, and a table
  of ``max_pages`` pages is mostly empty early in a request. A ``lax.switch`` picks the
  smallest of a few page counts (:func:`~jaxlab.kernels.paged.page_buckets`) that holds every query's
  position, as :mod:`jaxlab.kernels.xla` does for its visible prefix; the pages past it
  lie in every query's future, so the result equals attending over all of them.
* **A row gather, then grouped dots over kv-head-major pages.** The pool is ``[K,
  num_pages, page_size, D]``, so kv head ``j``'s page ``p`` is row ``j * num_pages + p``
  of a 2-D ``[K * num_pages, page_size * D]`` view. The visible pages of every row are
  gathered as whole rows of that view (XLA:CPU copies such rows as blocks; the same
  gather over the 4-D pool, or fused into a transpose, runs element by element and costs
  several times more), and the gathered ``[K, B, S, D]`` already has the dots' batch axes
  ``(K, B)`` leading: each kv head's queries of a row form one ``[G * T, D]`` matrix
  against that row's ``[S, D]`` slab, with no transpose of the cache. The forms tried
  against it, ``jax.nn.dot_product_attention`` and the ``xla_cpu`` kernel's grouped
  einsum over a gathered ``[B, S, K, D]`` cache, both pay a transpose of the gathered
  pages per layer per step and ran several times slower.

A lane-dense pool (``paged_pallas``'s, :mod:`jaxlab.kernels.paged_dense`: how that kernel
runs prefill chunks and the shapes Mosaic cannot tile) is gathered as whole pages and its
heads transposed out of the lanes, a copy the other layout does not need.

An int8 pool (:mod:`jaxlab.kernels.paged`) is read without dequantizing the pages: the
gathered int8 values go into the dots, and the per-position scales multiply the logits (K)
and the probabilities (V), which is the same sum.

Softmax reductions run in two stages where the platform wants it
(:mod:`jaxlab.kernels.reduce`). The gather is still a copy of every page a step reads; on
XLA:CPU the engine's decode calls avoid it by staging (:mod:`jaxlab.kernels.staged`), and
this kernel reads pages in prefill's chunks and wherever pages are not staged.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxlab.kernels.masks import MASK_VALUE
from jaxlab.kernels.paged import PagedLayer, PagedLayout, page_buckets, visible_slots
from jaxlab.kernels.paged_dense import gather_pages
from jaxlab.kernels.reduce import softmax_last

Array = jax.Array


def attend_pages(q: Array, layer: PagedLayer, positions: Array, n: int) -> Array:
    """``q [B, T, H, D]`` at ``positions [B, T]`` over the first ``n`` table pages of each
    row (module docstring) -> ``[B, T, H, D]``."""
    b, t, h, d = q.shape
    num_pages, ps = layer.num_pages, layer.page_size
    kv = layer.dense_heads or layer.k.shape[0]
    g = h // kv
    s = n * ps
    pages = jnp.minimum(layer.table[:, :n], num_pages - 1).reshape(-1)  # NO_PAGE: masked below
    rows = (jnp.arange(kv, dtype=jnp.int32)[:, None] * num_pages + pages[None, :]).reshape(-1)

    def gather(pool: Array) -> Array:
        if layer.dense_heads is not None:  # paged_pallas's pool (paged_dense), for T > 1
            got = gather_pages(pool, layer.table[:, :n], kv)  # [B, S, K, D]
            return got.transpose(2, 0, 1, 3).astype(q.dtype)
        flat = pool.reshape(kv * num_pages, ps * d)
        return jnp.take(flat, rows, axis=0, mode="clip").reshape(kv, b, s, d).astype(q.dtype)

    def scales(scale: Array) -> Array:  # an int8 pool's [kv, b, 1, s], beside the pages
        flat = scale.reshape(kv * num_pages, ps)
        return jnp.take(flat, rows, axis=0, mode="clip").reshape(kv, b, 1, s)

    k, v = gather(layer.k), gather(layer.v)
    qh = q.reshape(b, t, kv, g, d).transpose(2, 0, 3, 1, 4).reshape(kv, b, g * t, d)
    logits = jnp.einsum("kbqd,kbsd->kbqs", qh, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    if layer.k_scale is not None:  # q . (k * s) = (q . k) * s: the int8 keys are dotted as is
        logits = logits * scales(layer.k_scale)
    visible = visible_slots(positions, layer.table[:, :n], num_pages, ps)  # [B, T, S]
    logits = logits.reshape(kv, b, g, t, s)
    logits = jnp.where(visible[None, :, None], logits, MASK_VALUE).reshape(kv, b, g * t, s)
    probs = softmax_last(logits)
    if layer.v_scale is not None:  # sum_s p_s (v_s * s_s) = sum_s (p_s * s_s) v_s
        probs = probs * scales(layer.v_scale)
    out = jnp.einsum("kbqs,kbsd->kbqd", probs.astype(q.dtype), v)
    return out.reshape(kv, b, g, t, d).transpose(1, 3, 0, 2, 4).reshape(b, t, h, d)


class PagedXla(PagedLayout):
    name = "paged_xla"

    def attend_cache(self, q: Array, cache: PagedLayer, positions: Array) -> Array:
        counts = page_buckets(cache.table.shape[1], cache.page_size)

        def over(n: int) -> Callable[[Array, PagedLayer, Array], Array]:
            def attend_n(q: Array, layer: PagedLayer, positions: Array) -> Array:
                return attend_pages(q, layer, positions, n)

            return attend_n

        if len(counts) == 1:
            return attend_pages(q, cache, positions, counts[0])
        need = jnp.max(positions) // cache.page_size + 1  # pages holding every query
        index = jnp.sum(jnp.asarray(counts[:-1]) < need)
        return jax.lax.switch(index, [over(n) for n in counts], q, cache, positions)


__all__ = ["PagedXla", "attend_pages"]
