"""A decode step's K/V write into a paged pool, written in Pallas: one token per row, each
into its own page.

:func:`jaxlab.kernels.paged.write_at` writes through the table with one XLA scatter per
buffer. On a TPU a scatter into the pool costs a near-fixed time per call whatever it
writes, while a decode step writes a few kilobytes per layer (a profile of the
``tpu-small`` batch-1 decode step on a v5e, with the figures: ``docs/performance.md``).
This kernel does the same write as copies:

* **Whole pages, read, patched, written back.** The pool is lane-dense, ``[num_pages,
  page_size, K * D]`` (:mod:`jaxlab.kernels.paged_dense`), so one token is one sublane row
  of a tile: a copy cannot address it alone. Each row's page (``pool[page]``, one
  contiguous block of every kv head) is copied into VMEM, the token's slot is replaced by
  a select against an iota (no dynamic store), and the page is copied back.
  A row owns the page it writes (the host never lends a page writable twice), so no two
  rows patch the same page.
* **All reads in flight before the first wait.** A grid step handles ``rows`` rows: it
  starts every row's K and V page reads, waits for them, patches and starts every write,
  then waits for those: two copy latencies per step rather than four per row.
* **In place.** The pools are aliased to the outputs (``input_output_aliases``) and stay
  in HBM (``memory_space=ANY``); with the pool donated, nothing else is copied.
* **Skipped rows.** A row whose position is ``NO_SLOT`` (not computed, or finished), past
  its table, or on a ``NO_PAGE`` entry writes nothing, as with ``write_at``.

Lane-dense float pools only: an int8 pool quantizes what it writes and keeps scales
(:mod:`jaxlab.kernels.paged`), and goes to ``write_at``. On the CPU the kernel runs in
Pallas interpret mode, which is how CI tests it against
:func:`jaxlab.kernels.paged_dense.write_at` (they must agree bit for bit: both only move
values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxlab.kernels.paged import token_slots

Array = jax.Array

#: Rows per grid step: every one of them has a K and a V page in VMEM at once
#: (``2 * rows * page_size * K * D`` elements, 1.5 MiB for tpu-small's pages in bf16).
WRITE_ROWS = 32


def _kernel(page_ref, off_ref, k_new, v_new, _k_in, _v_in, k_pool, v_pool, k_buf, v_buf, sems):
    # The input pools and the output pools are one buffer each (aliased): read and written
    # through the outputs.
    rows = k_new.shape[0]
    n_pages = k_pool.shape[0]
    base = pl.program_id(0) * rows

    def copies(r: int, to_pool: bool) -> list:
        page = jnp.minimum(page_ref[base + r], n_pages - 1)  # a real page even if skipped
        pairs = ((k_pool, k_buf), (v_pool, v_buf))
        out = []
        for n, (pool, buf) in enumerate(pairs):
            src, dst = pool.at[page], buf.at[r]
            if to_pool:
                src, dst = dst, src
            out.append(pltpu.make_async_copy(src, dst, sems.at[n, int(to_pool)]))
        return out

    def each(fn) -> None:
        for r in range(rows):
            pl.when(page_ref[base + r] < n_pages)(functools.partial(fn, r))

    def start_reads(r: int) -> None:
        for c in copies(r, to_pool=False):
            c.start()

    def wait_reads(r: int) -> None:
        for c in copies(r, to_pool=False):
            c.wait()

    def wait_writes(r: int) -> None:
        for c in copies(r, to_pool=True):
            c.wait()

    each(start_reads)
    each(wait_reads)

    def patch(r: int) -> None:
        for new, buf in ((k_new, k_buf), (v_new, v_buf)):
            page = buf[r]  # [page_size, K * D]
            slot = lax.broadcasted_iota(jnp.int32, page.shape, 0)
            token = jnp.broadcast_to(new[r].astype(page.dtype), page.shape)  # from [1, K * D]
            buf[r] = jnp.where(slot == off_ref[base + r], token, page)
        for c in copies(r, to_pool=True):
            c.start()

    each(patch)
    each(wait_writes)


def write_token(
    k_pool: Array,
    v_pool: Array,
    table: Array,
    k: Array,
    v: Array,
    positions: Array,
    *,
    rows: int = WRITE_ROWS,
    interpret: bool | None = None,
) -> tuple[Array, Array]:
    """``k, v [B, K * D]``, one token per row at ``positions i32[B]``, written through
    ``table i32[B, max_pages]`` into the lane-dense ``k_pool, v_pool [num_pages, page_size,
    K * D]`` (module docstring) -> the new pools. ``interpret`` defaults to Pallas interpret
    mode on the CPU backend."""
    num_pages, page_size, lanes = k_pool.shape
    b = k.shape[0]
    if k.shape != (b, lanes) or v.shape != k.shape or table.shape[0] != b:
        raise ValueError(
            f"write_token: k, v must be [B, K * D] = [{b}, {lanes}] with a table of B "
            f"rows; got k {k.shape}, v {v.shape}, table {table.shape}"
        )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    # The scatter's own slots: a token it would drop has a slot past the pool, so its page
    # comes out >= num_pages and the kernel skips it.
    slots = token_slots(table, positions.astype(jnp.int32)[:, None], num_pages, page_size)[:, 0]
    rows = max(1, min(rows, b))
    bp = -(-b // rows) * rows
    page = jnp.pad(slots // page_size, (0, bp - b), constant_values=num_pages)
    off = jnp.pad(slots % page_size, (0, bp - b))
    # [B, 1, K * D]: row r's token is a [1, K * D] tile row, broadcast over its page.
    k, v = (jnp.pad(x, ((0, bp - b), (0, 0)))[:, None, :] for x in (k, v))
    new_spec = pl.BlockSpec((rows, 1, lanes), lambda i, *_: (i, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((rows, page_size, lanes), k_pool.dtype)
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(bp // rows,),
            in_specs=[new_spec, new_spec, any_spec, any_spec],
            out_specs=[any_spec, any_spec],
            scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
            jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype),
        ],
        # Operands count the two scalar-prefetch arrays: the pools are operands 4 and 5.
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="jaxlab_paged_write",
    )(page, off, k, v, k_pool, v_pool)


__all__ = ["WRITE_ROWS", "write_token"]
