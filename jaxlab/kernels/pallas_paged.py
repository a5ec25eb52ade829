"""Paged decode attention written in Pallas: one query token per row over that row's pages.

This module owns the Pallas kernel and its wrapper, :func:`paged_decode`;
:class:`jaxlab.kernels.paged_pallas.PagedPallas` is the paged kernel that calls it. The
static sizes come from :mod:`jaxlab.kernels.paged_plan`. ``docs/kernels.md`` ("The paged
decode kernel") explains the design at length; in short:

* **Grid.** One axis, over groups of ``rows_per_step`` batch rows. A grid step walks its
  rows one after another and each row's compute blocks in order (``pages_per_block``
  pages, ``tokens`` slots each) as one flat sequence of (row, block) items.
* **Scalars first.** Each row's visible length (``position + 1``) and the page table
  (flattened) are scalar-prefetch operands: they sit in SMEM before the kernel starts,
  and the kernel reads the page ids of a block from them to address its copies.
* **Lane-dense pages.** The pools are ``[num_pages, page_size, K * D]``
  (:mod:`jaxlab.kernels.paged_dense`): a page of every kv head is one contiguous block
  whose TPU tiles hold no padding, where a ``[K, num_pages, page_size, 64]`` pool would
  move two bytes for every byte of K/V.
* **Only the pages a row needs.** The pools stay in HBM (``memory_space=ANY``). Each
  item's pages are copied by hand (``make_async_copy``), one DMA per page and buffer
  (``pool[page]``, ``[page_size, K * D]``), into one of ``slots`` VMEM buffers (two by
  default): while item ``i`` is computed, items ``i + 1 .. i + slots - 1`` have their
  pages in flight, across row boundaries too. A row
  walks ``ceil(length / tokens)`` blocks, and in its last block only the pages holding
  visible positions are copied, by a loop of as many trips: no byte past a row's length
  is read, and no table entry past it is even looked at (``NO_PAGE`` entries are never
  copied either).
* **Every head in one pair of dots.** Query head ``h`` enters as a ``[K * D]`` lane row
  holding its ``D`` values in its kv head's lanes and zeros elsewhere, so one ``[H, K * D]
  x [K * D, tokens]`` dot gives every head's logits against the block (the zeros drop the
  other heads' keys), and one ``[H, tokens] x [tokens, K * D]`` dot every head's weighted
  values, of which head ``h`` keeps its own kv head's lanes. Two dots and one softmax per
  block, where a dot pair per kv head left the MXU idle between small dependent steps;
  the extra multiplications by zero cost the MXU, not memory. At a row's end each head's
  own lanes are folded onto ``D`` lanes by a dot with a 0/1 matrix (one term per output:
  exact). ``H`` is padded to a whole sublane tile (padding rows are zeros and are sliced
  off).
* **Online softmax** across a row's blocks, as in the flash kernel
  (:mod:`jaxlab.kernels.pallas_flash`): running max ``m``, sum ``l`` and unnormalised
  output ``acc`` in VMEM, f32; the output is ``acc / l`` after the row's last block.
* **Masks only where needed.** A block lying wholly inside the row's length with every
  page present runs without a mask; the row's last block masks the positions past its
  length; every block of a row with a missing page (``NO_PAGE`` inside its length, found
  by the wrapper) also masks page by page. Masked logits get the finite ``MASK_VALUE``
  and masked probabilities are 0, so what the unread slots hold (an earlier item's
  pages, or zeros) never counts; a row that sees nothing comes out as zeros. The mask is on the ``[H, tokens]`` logits only,
  never on the ``[tokens, K * D]`` values, which would cost a select per value.
* **Work that follows the length.** A row's last block is computed over the narrowest
  slice of :attr:`~jaxlab.kernels.paged_plan.PagedPlan.widths` that holds its visible
  slots (128, 256 or all 512 of a default block): each width is its own branch, so a
  32-token row costs one 128-wide pair of dots rather than a 512-wide one.
* **Precision** as in :mod:`jaxlab.kernels.base`: K/V cast to the query dtype, f32
  logits, softmax and accumulators, probabilities cast to the value dtype for the second
  dot, output in the query dtype.
* **CPU.** With no TPU the same kernel runs in Pallas interpret mode, which is how CI
  tests it; Mosaic's tiling rules are checked by :func:`~jaxlab.kernels.paged_plan.mosaic_problem`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxlab.kernels.masks import MASK_VALUE
from jaxlab.kernels.paged_plan import LANES, PagedBlocks, PagedPlan, make_plan

Array = jax.Array

#: ``a @ b^T`` for 2-D tiles: contract the last dimension of both.
NT = (((1,), (1,)), ((), ()))
F32 = jnp.float32


def widen(x: Array, width: int) -> Array:
    """A lane-replicated ``[n, 128]`` column as ``[n, width]``."""
    if width == LANES:
        return x
    if width < LANES:
        return x[:, :width]
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


class _Item:
    """One (row, block) of a grid step: its scalars, read from SMEM, and its page copies."""

    def __init__(self, refs, plan: PagedPlan, num_pages: int, row: Array, block: Array) -> None:
        lengths_ref, holes_ref, table_ref, k_hbm, v_hbm, k_buf, v_buf, sems = refs
        ppb, ps = plan.pages_per_block, plan.page_size
        self.length = lengths_ref[row]  # clipped to [0, max_tokens] by the wrapper
        self.tokens = plan.block_tokens
        self.first = block * plan.block_tokens  # position of the block's first slot
        self.base = row * plan.table_width + block * ppb
        # The block's pages holding visible positions: a prefix of its pages.
        self.n_pages = jnp.clip(lax.div(self.length - self.first + ps - 1, ps), 0, ppb)
        #: The row has a ``NO_PAGE`` entry inside its length: its blocks mask page by page.
        self.holes = holes_ref[row] != 0
        self._table = table_ref
        self._num_pages = num_pages
        self._ppb = ppb
        self._bufs = (k_hbm, v_hbm, k_buf, v_buf, sems)
        self._ps = ps

    @property
    def full(self) -> Array:
        """Every slot of the block lies inside the row's length."""
        return self.first + self.tokens <= self.length

    def missing(self) -> list[Array]:
        """Per page of the block (statically indexed): its table entry is ``NO_PAGE``."""
        return [self._table[self.base + i] >= self._num_pages for i in range(self._ppb)]

    def _each_page(self, slot: Array, act) -> None:
        """``act(copy)`` for the K and V copies of each present page among the block's
        first ``n_pages``: a loop of that many trips, not a branch per page the block holds."""
        k_hbm, v_hbm, k_buf, v_buf, sems = self._bufs
        ps = self._ps

        def body(i: Array, carry: Array) -> Array:
            page = self._table[self.base + i]
            src_page = jnp.minimum(page, self._num_pages - 1)  # a real page even if unread
            dst = pl.ds(pl.multiple_of(i * ps, ps), ps)
            # One contiguous copy per page and buffer: [page_size, K * D], every kv head.
            copies = [
                pltpu.make_async_copy(src.at[src_page], buf.at[slot, dst], sems.at[n, slot])
                for n, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf)))
            ]

            @pl.when(page < self._num_pages)
            def _act():
                for c in copies:
                    act(c)

            return carry

        lax.fori_loop(0, self.n_pages, body, jnp.int32(0))

    def start(self, slot: Array) -> None:
        self._each_page(slot, lambda copy: copy.start())

    def wait(self, slot: Array) -> None:
        self._each_page(slot, lambda copy: copy.wait())


def _visible(item: _Item, plan: PagedPlan, shape: tuple[int, int], holes: bool) -> Array:
    """``bool[shape]``: the block's slot (along the lanes) holds a visible position:
    inside the row's length and, with ``holes``, on a page that is present."""
    slot = lax.broadcasted_iota(jnp.int32, shape, 1)
    visible = item.first + slot < item.length
    if holes:  # compares with constants: no vector integer division for Mosaic to lower
        ps = plan.page_size
        for i, missing in enumerate(item.missing()):
            visible = visible & ~((slot >= i * ps) & (slot < (i + 1) * ps) & missing)
    return visible


def _kernel(
    lengths_ref,
    holes_ref,
    table_ref,
    q_ref,
    own_ref,
    pick_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    sems,
    m_scr,
    l_scr,
    acc_scr,
    *,
    plan: PagedPlan,
    num_pages: int,
    scale: float,
):
    lanes = q_ref.shape[2]  # K * D
    tokens = plan.block_tokens
    rows = plan.rows_per_step
    n_slots = plan.slots
    step = pl.program_id(0)
    refs = (lengths_ref, holes_ref, table_ref, k_hbm, v_hbm, k_buf, v_buf, sems)

    def item(r: Array, block: Array) -> _Item:
        return _Item(refs, plan, num_pages, step * rows + r, block)

    def n_blocks(r: Array) -> Array:
        # r may lie past the step's rows (the prefetch cursor at the end): read a real row.
        index = jnp.minimum(step * rows + r, lengths_ref.shape[0] - 1)
        return jnp.maximum(1, lax.div(lengths_ref[index] + tokens - 1, tokens))

    def advance(r: Array, block: Array) -> tuple[Array, Array]:
        """The item after (r, block) in the step's flat sequence."""
        last = block + 1 >= n_blocks(r)
        return jnp.where(last, r + 1, r), jnp.where(last, 0, block + 1)

    def prefetch(r: Array, block: Array, slot: Array) -> tuple[Array, Array]:
        """Start item (r, block)'s copies into ``slot`` if it is one of the step's; the
        item after it."""

        @pl.when(r < rows)
        def _start():
            item(r, block).start(slot)

        return advance(r, block)

    def compute(
        r: Array, it: _Item, slot: Array, masked: bool, holes: bool, width: int = tokens
    ) -> None:
        # Over the block's first `width` slots only: the caller makes sure no visible slot
        # lies past them. Every query head against every kv head's lanes at once: q is zero
        # outside its own kv head's lanes, so each logit is its own head's dot.
        if masked:
            keep = _visible(it, plan, (plan.heads_padded, width), holes)
        q = q_ref[r]  # [Hp, K * D]
        k = k_buf[slot, :width].astype(q.dtype)  # [width, K * D]
        v = v_buf[slot, :width].astype(q.dtype)
        s = lax.dot_general(q, k, NT, preferred_element_type=F32)  # [Hp, width]
        if scale != 1.0:
            s = s * scale
        if masked:
            s = jnp.where(keep, s, MASK_VALUE)  # also drops what unread slots hold
        m_prev = m_scr[...]  # [Hp, 128], every lane holds the row's value
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - widen(m_next, width))
        if masked:
            # Exactly 0 already unless the block sees nothing (then m = MASK_VALUE).
            p = jnp.where(keep, p, 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
        m_scr[...] = m_next
        # [Hp, K * D]: head h's own lanes hold its output; the others are sums over
        # other heads' values, finite, and dropped at the row's end.
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
        acc_scr[...] = acc_scr[...] * widen(alpha, lanes) + pv

    def row_body(r: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)

        def block_body(
            block: Array, carry: tuple[Array, Array, Array]
        ) -> tuple[Array, Array, Array]:
            # Item i's pages sit in slot i % slots. Before they are awaited, item i + slots
            # - 1 (the cursor) starts into the slot item i - 1 has just left.
            i, cursor_r, cursor_block = carry
            ahead = lax.rem(i + n_slots - 1, n_slots)
            cursor_r, cursor_block = prefetch(cursor_r, cursor_block, ahead)
            slot = lax.rem(i, n_slots)
            it = item(r, block)
            it.wait(slot)
            full, holes = it.full, it.holes
            pl.when(full & ~holes)(lambda: compute(r, it, slot, masked=False, holes=False))
            # A row's last block: the narrowest slice holding its visible slots.
            seen = it.length - it.first
            narrower = 0
            for width in plan.widths:
                fits = ~full & ~holes & (seen > narrower) & (seen <= width)
                pl.when(fits)(
                    functools.partial(compute, r, it, slot, masked=True, holes=False, width=width)
                )
                narrower = width
            pl.when(holes)(lambda: compute(r, it, slot, masked=True, holes=True))
            return i + 1, cursor_r, cursor_block

        carry = lax.fori_loop(0, n_blocks(r), block_body, carry)
        row_sum = l_scr[...]
        row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)  # saw nothing: acc is 0
        out = (acc_scr[...] / widen(row_sum, lanes)).astype(o_ref.dtype)
        out = jnp.where(own_ref[...] != 0, out, jnp.zeros_like(out))  # each head's own lanes
        # Fold the kv heads' lane groups onto D lanes: one nonzero term per output, exact.
        o_ref[r] = jnp.dot(
            out, pick_ref[...], preferred_element_type=F32, precision=_exact(out.dtype)
        ).astype(o_ref.dtype)
        return carry

    # Value slots a block does not copy into are multiplied by probabilities of exactly
    # 0: they must hold finite numbers, so the buffers start as zeros, not as whatever
    # VMEM held (afterwards they hold pool data, finite like everything the pool holds).
    v_buf[...] = jnp.zeros(v_buf.shape, v_buf.dtype)
    # The first slots - 1 items start before any is awaited.
    cursor = (jnp.int32(0), jnp.int32(0))
    for j in range(n_slots - 1):
        cursor = prefetch(*cursor, jnp.int32(j))
    lax.fori_loop(0, rows, row_body, (jnp.int32(0), *cursor))


def _exact(dtype) -> lax.Precision | None:
    """A dot that only moves 32-bit values must not round them through bf16 passes."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize == 4 else None


def paged_decode(
    q: Array,
    k_pool: Array,
    v_pool: Array,
    table: Array,
    lengths: Array,
    *,
    blocks: PagedBlocks | None = None,
    interpret: bool | None = None,
) -> Array:
    """Decode attention: ``q [B, H, D]`` (one token per row) over each row's first
    ``lengths[b]`` positions, read through ``table i32[B, max_pages]`` from the lane-dense
    pools ``k_pool, v_pool [num_pages, page_size, K * D]``
    (:mod:`jaxlab.kernels.paged_dense`) -> ``[B, H, D]`` in q's dtype.

    Positions whose table entry is ``NO_PAGE`` (``>= num_pages``) are invisible. A row
    that sees nothing (``lengths[b] <= 0``, or only missing pages) comes out as zeros.
    ``interpret`` defaults to Pallas interpret mode on the CPU backend.
    """
    b, h, d = q.shape
    num_pages, page_size, lanes = k_pool.shape
    n_kv = lanes // d
    if v_pool.shape != k_pool.shape or lanes % d or h % max(n_kv, 1):
        raise ValueError(
            f"paged_decode: pools must be [num_pages, page_size, K * D] with D = {d} and K "
            f"dividing the {h} heads of q {q.shape}; got k {k_pool.shape}, v {v_pool.shape}"
        )
    if table.ndim != 2 or table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(
            f"paged_decode: table must be [B, max_pages] and lengths [B], B = {b}; got "
            f"table {table.shape}, lengths {lengths.shape}"
        )
    plan = make_plan(
        blocks or PagedBlocks(),
        batch=b,
        max_pages=table.shape[1],
        page_size=page_size,
        n_heads=h,
        n_kv_heads=n_kv,
        head_dim=d,
        q_dtype=q.dtype,
        pool_dtype=k_pool.dtype,
    )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    scale = 1.0 / math.sqrt(d)
    if math.frexp(scale)[0] == 0.5:
        # A power of two (D = 16, 64, 256): folded into q exactly, one multiply per logit saved.
        q, scale = q * jnp.asarray(scale, q.dtype), 1.0
    hp, bp = plan.heads_padded, plan.padded_batch
    # own[h, c]: lane c belongs to query head h's kv head (lane c holds kv head c // D).
    kv_of_head = jnp.arange(h) // (h // n_kv)
    own = (jnp.arange(lanes)[None, :] // d == kv_of_head[:, None]).astype(q.dtype)  # [H, K*D]
    q_lanes = jnp.tile(q, (1, 1, n_kv)) * own[None]  # [B, H, K * D], zero off its kv head
    q_lanes = jnp.pad(q_lanes, ((0, bp - b), (0, hp - h), (0, 0)))
    own = jnp.pad(own, ((0, hp - h), (0, 0)))
    pick = (jnp.arange(lanes)[:, None] % d == jnp.arange(d)[None, :]).astype(q.dtype)
    table = jnp.pad(
        table.astype(jnp.int32),
        ((0, bp - b), (0, plan.table_width - table.shape[1])),
        constant_values=num_pages,
    )
    lengths = jnp.pad(jnp.clip(lengths.astype(jnp.int32), 0, plan.max_tokens), (0, bp - b))
    # A row with a NO_PAGE entry among the pages its length covers.
    covered = (
        jnp.arange(plan.table_width)[None, :] < (lengths[:, None] + page_size - 1) // page_size
    )
    holes = jnp.any((table >= num_pages) & covered, axis=1).astype(jnp.int32)
    rows = plan.rows_per_step
    q_spec = pl.BlockSpec((rows, hp, lanes), lambda i, *_: (i, 0, 0))
    o_spec = pl.BlockSpec((rows, hp, d), lambda i, *_: (i, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((plan.slots, plan.block_tokens, lanes), k_pool.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, plan=plan, num_pages=num_pages, scale=scale),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(plan.steps,),
            in_specs=[
                q_spec,
                pl.BlockSpec((hp, lanes), lambda i, *_: (0, 0)),
                pl.BlockSpec((lanes, d), lambda i, *_: (0, 0)),
                any_spec,
                any_spec,
            ],
            out_specs=o_spec,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((2, plan.slots)),
                pltpu.VMEM((hp, LANES), F32),
                pltpu.VMEM((hp, LANES), F32),
                pltpu.VMEM((hp, lanes), F32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((bp, hp, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=_cost(plan, b, lanes, k_pool.dtype.itemsize),
        interpret=interpret,
        name="jaxlab_paged_decode",
    )(lengths, holes, table.reshape(-1), q_lanes, own, pick, k_pool, v_pool)
    return out[:b, :h]


def _cost(plan: PagedPlan, b: int, lanes: int, itemsize: int) -> pl.CostEstimate:
    """What XLA's scheduler is told: at most every table page of every row, K and V."""
    slots = b * plan.max_tokens
    return pl.CostEstimate(
        flops=4 * slots * plan.heads_padded * lanes,
        transcendentals=slots * plan.heads_padded,
        bytes_accessed=2 * slots * lanes * itemsize,
    )


__all__ = ["PagedBlocks", "paged_decode"]
