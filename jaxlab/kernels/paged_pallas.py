"""The ``paged_pallas`` kernel: decode attention over a paged cache by the Pallas kernel of
:mod:`jaxlab.kernels.pallas_paged` (the paged counterpart of ``pallas``).

What runs where:

* **Decode** (one query token per row, ``T = 1``): the Pallas kernel, reading each row's
  pages through the table, only those its position needs. Compiled by Mosaic on a TPU,
  Pallas interpret mode on the CPU (how CI tests it).
* **The decode write** (``T = 1``, a float pool): the Pallas kernel of
  :mod:`jaxlab.kernels.pallas_paged_write` patches each row's page in place, where an XLA
  scatter costs a near-fixed time per call on a TPU; under the same conditions as the
  decode kernel, and its own gate, :data:`WRITE_CHIP_VALIDATED`. Every other write is
  :func:`~jaxlab.kernels.paged.write_at`'s scatter.
* **Extend** (``T > 1``: prefill chunks, several tokens per row against the pages), an
  int8 pool (``inference.kv_cache_dtype = "int8"``: the kernel reads float pages only), and
  decode on a TPU with a page size Mosaic cannot tile
  (:func:`~jaxlab.kernels.paged_plan.mosaic_problem`) or on any other accelerator: the
  ``paged_xla`` kernel, the same math.

**The pool layout.** Float pools are lane-dense, ``[num_pages, page_size, K * D]``
(:class:`~jaxlab.kernels.paged_dense.PagedDenseLayout`, which says why); both Pallas
kernels read and write that layout only, and ``paged_xla`` reads it for the calls above.
int8 pools keep the kv-head-major layout of :mod:`jaxlab.kernels.paged`, as does a float
pool handed in by another kernel, which also goes to ``paged_xla``.

**Validated on a chip.** ``jaxlab/bench/tpu_bench.sh kernels`` runs
``tpu_kernel_smoke.py`` first: Mosaic compiles the kernel for each of its shapes on the TPU
and compares it with ``paged_reference``. :data:`CHIP_VALIDATED` records that it passed
(on one v5e chip, JAX 0.10.2: ``docs/performance.md``); it is the default of
:class:`PagedPallas`'s ``tpu``, so a kernel that regresses on a new JAX can be sent back to
``paged_xla`` on TPUs by one constant while it is fixed, without touching a config.

Pallas is imported on the first call, not with :mod:`jaxlab.kernels`, as for
:mod:`jaxlab.kernels.pallas`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlab.kernels.paged import PagedLayer
from jaxlab.kernels.paged_dense import PagedDenseLayout
from jaxlab.kernels.paged_plan import PagedBlocks, mosaic_problem
from jaxlab.kernels.paged_xla import PagedXla

Array = jax.Array


#: Whether the kernel has compiled and matched the reference on a TPU (module docstring):
#: the default of :class:`PagedPallas`'s ``tpu``. ``False`` sends TPU decode to ``paged_xla``.
CHIP_VALIDATED = True
#: The same for the decode write (:mod:`jaxlab.kernels.pallas_paged_write`): the default of
#: :class:`PagedPallas`'s ``tpu_write``. ``False`` sends TPU decode writes to the scatter.
WRITE_CHIP_VALIDATED = True


def runs_pallas(
    t: int, page_size: int, pool_dtype, backend: str, *, tpu: bool = CHIP_VALIDATED
) -> bool:
    """Whether a call of ``t`` query tokens per row runs the Pallas kernel on ``backend``
    (module docstring), rather than ``paged_xla``; ``tpu``: whether it may on a TPU."""
    if t != 1:
        return False
    if backend == "cpu":
        return True  # interpret mode: no tiling rules
    return backend == "tpu" and tpu and mosaic_problem(page_size, pool_dtype) is None


class PagedPallas(PagedDenseLayout):
    name = "paged_pallas"

    def __init__(
        self,
        blocks: PagedBlocks | None = None,
        *,
        tpu: bool = CHIP_VALIDATED,
        tpu_write: bool = WRITE_CHIP_VALIDATED,
    ) -> None:
        self.blocks = blocks or PagedBlocks()
        self.tpu = tpu
        self.tpu_write = tpu_write
        self._xla = PagedXla()

    def write(self, cache: PagedLayer, k: Array, v: Array, start: Array) -> PagedLayer:
        # One token per row into a lane-dense pool: the Pallas write where the kernel runs.
        if cache.dense_heads is None or not runs_pallas(
            k.shape[1], cache.page_size, cache.k.dtype, jax.default_backend(), tpu=self.tpu_write
        ):
            return super().write(cache, k, v, start)
        from jaxlab.kernels.pallas_paged_write import write_token

        b = k.shape[0]
        k_pool, v_pool = write_token(
            cache.k, cache.v, cache.table, k.reshape(b, -1), v.reshape(b, -1), start
        )
        return dataclasses.replace(cache, k=k_pool, v=v_pool)

    def attend_cache(self, q: Array, cache: PagedLayer, positions: Array) -> Array:
        backend = jax.default_backend()
        # The Pallas kernel reads lane-dense float pages only; an int8 pool goes to paged_xla.
        if cache.dense_heads is None or not runs_pallas(
            q.shape[1], cache.page_size, cache.k.dtype, backend, tpu=self.tpu
        ):
            return self._xla.attend_cache(q, cache, positions)
        from jaxlab.kernels.pallas_paged import paged_decode

        # A query at position p sees positions 0 .. p: the first p + 1 of its row.
        lengths = positions[:, 0].astype(jnp.int32) + 1
        out = paged_decode(q[:, 0], cache.k, cache.v, cache.table, lengths, blocks=self.blocks)
        return out[:, None]


__all__ = ["CHIP_VALIDATED", "WRITE_CHIP_VALIDATED", "PagedBlocks", "PagedPallas", "runs_pallas"]
