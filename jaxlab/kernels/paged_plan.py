"""The static plan of the Pallas paged decode kernel: how many pages one compute block
holds, how many rows one grid step walks, the padded shapes, and which shapes Mosaic
compiles.

Everything here is decided from shapes alone, before anything is traced; the kernel in
:mod:`jaxlab.kernels.pallas_paged` only reads the :class:`PagedPlan` it is given.

Why the sizes are what they are (``docs/kernels.md``, "The paged decode kernel"):

* **Pages per block.** A block is the unit of the kernel's online softmax and of its
  double buffering: while block ``i`` is computed, block ``i + 1``'s pages are being
  copied from HBM. Larger blocks pay the fixed cost of a step (a loop trip, the dots'
  pipeline fill, the waits) less often; they cost no extra bytes, since pages past a
  row's length are never copied, and little extra compute: a row's last block is
  computed over the narrowest of a ladder of slices (:attr:`PagedPlan.widths`) that
  holds its visible slots, so a short row's one block is not a block's worth of dots
  and softmax. The default aims at :attr:`PagedBlocks.block_tokens` tokens, rounded so
  that a block's logits ``[H, tokens]`` fill whole 128-lane vregs, and capped so the
  buffer slots of a block's K and V (every kv head) fit :data:`VMEM_BUFFER_BYTES`.
* **Rows per grid step.** A grid step walks its rows' blocks in one flat sequence, so
  the first block of the next row is copied while the current row's last block is
  computed; only each step's very first copy is exposed. More rows per step expose fewer
  copies; the query and output blocks of a step grow with it.
* **Padded query heads.** The ``H`` query heads of a row are the rows of the block's dots
  (each against every kv head's lanes, :mod:`jaxlab.kernels.pallas_paged`). They are
  padded to a whole sublane tile (8 rows in 32-bit, 16 in 16-bit) so the query block, the
  logits and the accumulators are whole vreg tiles whatever ``H`` is: no partial layouts
  for Mosaic to reject.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.typing import DTypeLike

#: TPU vector registers are 128 lanes wide.
LANES = 128
#: VMEM given to the K/V page buffers (two slots each of K and V, every kv head). Well
#: under the 16 MiB that Mosaic lets a kernel use by default on TPU v5e, with room left
#: for the query and output blocks and the accumulators.
VMEM_BUFFER_BYTES = 8 * 2**20


def sublanes(dtype: DTypeLike) -> int:
    """Rows of one TPU vreg tile for ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class PagedBlocks:
    """The kernel's knobs. ``block_tokens``: tokens per compute block to aim at (the pages
    per block follow from the page size, :func:`pages_per_block`); ``pages_per_block``:
    exactly this many instead. ``rows_per_step``: batch rows per grid step (clamped to
    the batch). ``slots``: VMEM buffers per K and V, so ``slots - 1`` items' copies are in
    flight while one is computed (2: double buffering; more hide a copy's latency behind
    several short rows). ``min_width``: the narrowest slice of a block a row's last block is
    computed over (:attr:`PagedPlan.widths`; a whole lane row by default, smaller only for
    tests of the ladder on small shapes)."""

    block_tokens: int = 512
    pages_per_block: int | None = None
    rows_per_step: int = 8
    slots: int = 2
    min_width: int = LANES

    def __post_init__(self) -> None:
        for field in ("block_tokens", "pages_per_block", "rows_per_step", "min_width"):
            value = getattr(self, field)
            if value is not None and value < 1:
                raise ValueError(f"PagedBlocks.{field}: must be at least 1, got {value}")
        if self.slots < 2:
            raise ValueError(f"PagedBlocks.slots: must be at least 2, got {self.slots}")


def pages_per_block(
    blocks: PagedBlocks,
    *,
    page_size: int,
    max_pages: int,
    n_kv_heads: int,
    head_dim: int,
    itemsize: int,
) -> int:
    """Pages per compute block (module docstring): ``blocks.pages_per_block`` when given;
    else ``block_tokens`` worth, no more than the table holds nor than
    :data:`VMEM_BUFFER_BYTES` allows, rounded to whole lanes when pages divide them (up,
    or down where up would not fit)."""
    if blocks.pages_per_block is not None:
        return blocks.pages_per_block
    # The slots of K and of V, each token's K * D values lane-dense, padded to whole lanes.
    row_bytes = 2 * blocks.slots * round_up(n_kv_heads * head_dim, LANES) * itemsize
    fits = max(1, VMEM_BUFFER_BYTES // (row_bytes * page_size))
    n = min(-(-min(blocks.block_tokens, max_pages * page_size) // page_size), fits)
    if LANES % page_size == 0:
        lane_pages = LANES // page_size
        if round_up(n, lane_pages) <= fits:
            n = round_up(n, lane_pages)
        elif n >= lane_pages:
            n = n // lane_pages * lane_pages
    return n


@dataclass(frozen=True)
class PagedPlan:
    """The shapes of one kernel call.

    ``batch`` rows are padded to ``padded_batch`` (a multiple of ``rows_per_step``);
    the table's ``max_pages`` columns to ``table_width`` (a multiple of
    ``pages_per_block``, padding entries ``NO_PAGE``); the ``heads`` query heads to
    ``heads_padded`` (a whole sublane tile of the query dtype).
    """

    batch: int
    rows_per_step: int
    page_size: int
    pages_per_block: int
    max_pages: int
    heads: int
    heads_padded: int
    slots: int = 2
    min_width: int = LANES

    @property
    def block_tokens(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def widths(self) -> tuple[int, ...]:
        """The slices, ascending, a row's last block is computed over: the block halved
        while a half stays a whole multiple of ``min_width``, down to ``min_width``
        (``(128, 256, 512)`` for blocks of 512). The kernel computes the narrowest that
        holds the block's visible slots: its work follows the row's length, not the block's."""
        out = [self.block_tokens]
        while out[-1] % 2 == 0 and (half := out[-1] // 2) >= self.min_width:
            if half % self.min_width:
                break
            out.append(half)
        return tuple(reversed(out))

    @property
    def padded_batch(self) -> int:
        return round_up(self.batch, self.rows_per_step)

    @property
    def steps(self) -> int:
        return self.padded_batch // self.rows_per_step

    @property
    def table_width(self) -> int:
        return round_up(self.max_pages, self.pages_per_block)

    @property
    def max_tokens(self) -> int:
        """The most positions a row can see: every table page."""
        return self.max_pages * self.page_size


def make_plan(
    blocks: PagedBlocks,
    *,
    batch: int,
    max_pages: int,
    page_size: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    q_dtype: DTypeLike,
    pool_dtype: DTypeLike,
) -> PagedPlan:
    """The plan of one call (module docstring)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"paged_pallas: {n_heads} query heads do not split over {n_kv_heads}")
    ppb = pages_per_block(
        blocks,
        page_size=page_size,
        max_pages=max_pages,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        itemsize=np.dtype(pool_dtype).itemsize,
    )
    return PagedPlan(
        batch=batch,
        rows_per_step=max(1, min(blocks.rows_per_step, batch)),
        page_size=page_size,
        pages_per_block=ppb,
        max_pages=max_pages,
        heads=n_heads,
        heads_padded=round_up(n_heads, sublanes(q_dtype)),
        slots=blocks.slots,
        min_width=blocks.min_width,
    )


def mosaic_problem(page_size: int, pool_dtype: DTypeLike) -> str | None:
    """Why Mosaic cannot compile the kernel over pages of ``page_size`` tokens in
    ``pool_dtype``, or None if it can. Each page is copied into its place in a block's
    ``[tokens, K * D]`` buffer, and a copy must start on a whole sublane tile of the buffer."""
    tile = sublanes(pool_dtype)
    if page_size % tile:
        return (
            f"inference.page_size = {page_size} is not a multiple of {tile}, the rows of a "
            f"TPU tile of {np.dtype(pool_dtype).name}"
        )
    return None


__all__ = [
    "LANES",
    "VMEM_BUFFER_BYTES",
    "PagedBlocks",
    "PagedPlan",
    "make_plan",
    "mosaic_problem",
    "pages_per_block",
    "round_up",
    "sublanes",
]
