"""The ``paged_pallas`` kernel: decode attention over a paged cache by the Pallas kernel of
:mod:`jaxlab.kernels.pallas_paged` (the paged counterpart of ``pallas``).

What runs where:

* **Decode** (one query token per row, ``T = 1``): the Pallas kernel, reading each row's
  pages through the table, only those its position needs. Compiled by Mosaic on a TPU,
  Pallas interpret mode on the CPU (how CI tests it).
* **Extend** (``T > 1``: prefill chunks, several tokens per row against the pages), and
  decode on a TPU with a page size Mosaic cannot tile
  (:func:`~jaxlab.kernels.paged_plan.mosaic_problem`) or on any other accelerator: the
  ``paged_xla`` kernel, the same math.

The pool layout, writes and inspection are every paged kernel's
(:class:`~jaxlab.kernels.paged.PagedLayout`). Pallas is imported on the first call, not
with :mod:`jaxlab.kernels`, as for :mod:`jaxlab.kernels.pallas`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlab.kernels.paged import PagedLayer, PagedLayout
from jaxlab.kernels.paged_plan import PagedBlocks, mosaic_problem
from jaxlab.kernels.paged_xla import PagedXla

Array = jax.Array


def runs_pallas(t: int, page_size: int, pool_dtype, backend: str) -> bool:
    """Whether a call of ``t`` query tokens per row runs the Pallas kernel on ``backend``
    (module docstring), rather than ``paged_xla``."""
    if t != 1:
        return False
    if backend == "cpu":
        return True  # interpret mode: no tiling rules
    return backend == "tpu" and mosaic_problem(page_size, pool_dtype) is None


class PagedPallas(PagedLayout):
    name = "paged_pallas"

    def __init__(self, blocks: PagedBlocks | None = None) -> None:
        self.blocks = blocks or PagedBlocks()
        self._xla = PagedXla()

    def attend_cache(self, q: Array, cache: PagedLayer, positions: Array) -> Array:
        if not runs_pallas(q.shape[1], cache.page_size, cache.k.dtype, jax.default_backend()):
            return self._xla.attend_cache(q, cache, positions)
        from jaxlab.kernels.pallas_paged import paged_decode

        # A query at position p sees positions 0 .. p: the first p + 1 of its row.
        lengths = positions[:, 0].astype(jnp.int32) + 1
        out = paged_decode(q[:, 0], cache.k, cache.v, cache.table, lengths, blocks=self.blocks)
        return out[:, None]


__all__ = ["PagedBlocks", "PagedPallas", "runs_pallas"]
