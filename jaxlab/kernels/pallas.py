"""The ``pallas`` kernel: sequence attention by the Pallas flash kernel
(:mod:`jaxlab.kernels.pallas_flash`). A contiguous decode cache, and attention over it, are
the ``xla`` kernel's (``[B, S, K, D]``); a paged cache is read by its paged counterpart,
``paged_pallas`` (:mod:`jaxlab.kernels.paged_pallas`), a Pallas decode kernel.

Pallas is imported on the first call, not with :mod:`jaxlab.kernels`: every program that
builds a model imports the kernel registry, and most never run this kernel.
"""

from __future__ import annotations

import jax

from jaxlab.kernels.flash_plan import BlockSizes
from jaxlab.kernels.xla import Xla

Array = jax.Array


class Pallas(Xla):
    name = "pallas"

    def __init__(self, block_sizes: BlockSizes | None = None) -> None:
        self.block_sizes = block_sizes or BlockSizes()

    def attend(self, q: Array, k: Array, v: Array, segment_ids: Array | None = None) -> Array:
        from jaxlab.kernels.pallas_flash import flash_attention

        return flash_attention(q, k, v, segment_ids, block_sizes=self.block_sizes)


__all__ = ["BlockSizes", "Pallas"]
