"""Suite ``paged-attention``: decode attention over a paged KV cache, the kernels alone.

One query token per row against a pool of pages, at the configured model's attention
shape: ``model.n_heads`` query heads over ``model.n_kv_heads`` kv heads of
``model.head_dim``, pages of ``inference.page_size`` tokens, in
``train.precision.compute_dtype``. Each row's pages are scattered across the pool (a
shuffled page table, as a long-running server's pool ends up). Shapes: batch 1, 8 and 32
at a context of 512 and 2,048 positions per row (``full``: every row at the end of its
context), and at the largest batch also ``ragged`` rows (lengths drawn from 1 to the
context: the pages past a row's length should cost nothing). ``--quick``: batch 1 and 8
at 512.

Kernels: jaxlab's ``paged_xla`` and ``paged_pallas`` (without --quick, at the largest
batch, also at other block and step sizes and with a copy per kv head) and, on TPU
only, the kernel that ships
inside jax, ``jax.experimental.pallas.ops.tpu.paged_attention``, at several
``pages_per_compute_block``. The Pallas kernels are left out off the TPU, and the suite
says so: on the CPU they run in interpret mode, whose time measures the interpreter.

Each kernel is compiled with the ahead-of-time API (``compile_s`` recorded apart), then
timed as usual, each sample the time of 64 calls back to back in one jitted loop divided
by 64 (a lone call would time the host's dispatch, which at batch 1 takes longer than
the kernel). Derived: ``us`` (the median in microseconds), ``kv_bytes`` (the K and V
bytes the rows must read: ``2 K D`` elements per visible position), the rate they are
read at against the datasheet's HBM bandwidth (:mod:`jaxlab.runtime.datasheet`) and the run's copy
(:meth:`~jaxlab.bench.context.BenchContext.bandwidth`), and ``max_abs_diff_vs_reference``
(against ``paged_reference``, computed untimed), so a fast wrong kernel is visible.

    jaxlab bench paged-attention --config tpu-small --set runtime.platform=tpu
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.suites import suite

#: ``(batches, contexts)`` measured, and with --quick.
SHAPES = ((1, 8, 32), (512, 2048))
QUICK_SHAPES = ((1, 8), (512,))
#: ``pages_per_compute_block`` of jax's own kernel (those that divide the table's width).
JAX_PAGES_PER_BLOCK = (8, 16)
JAX_PAGES_PER_BLOCK_QUICK = (8,)
#: Spare pages in the pool beyond every row's context.
SPARE_PAGES = 8
#: Calls timed per sample, back to back in one jitted loop (:func:`looped`).
CALLS = 64

#: ``fn(args) -> out [B, 1, H, D]`` over the arguments made by :func:`inputs`.
AttendFn = Callable[..., Any]


def kv_bytes(lengths: Any, n_kv: int, head_dim: int, itemsize: int) -> int:
    """K and V bytes the rows must read: ``2 K D`` elements per visible position."""
    return 2 * n_kv * head_dim * itemsize * int(sum(int(n) for n in lengths))


def pallas_variants(sweep: bool) -> list[tuple[str, Any]]:
    """``(label, PagedBlocks)`` of ``paged_pallas``: its defaults, and with ``sweep`` other
    block and step sizes."""
    from jaxlab.kernels.paged_plan import PagedBlocks

    out = [("default", PagedBlocks())]
    if sweep:
        out += [
            ("block_tokens=256", PagedBlocks(block_tokens=256)),
            ("block_tokens=1024", PagedBlocks(block_tokens=1024)),
            ("rows_per_step=1", PagedBlocks(rows_per_step=1)),
            ("rows_per_step=32", PagedBlocks(rows_per_step=32)),
            ("slots=3", PagedBlocks(slots=3)),
            ("slots=4", PagedBlocks(slots=4)),
        ]
    return out


def candidates(
    backend: str, quick: bool, table_width: int, sweep: bool = False
) -> list[tuple[dict[str, Any], AttendFn]]:
    """``(case fields, attend)`` of every kernel measured on ``backend``; ``attend(q,
    layer, positions, jax_table)`` (``jax_table``: the table with ``NO_PAGE`` entries
    clipped to a real page, which jax's kernel needs). ``sweep``: ``paged_pallas`` at
    other block sizes too (:func:`pallas_variants`; never with ``quick``)."""
    from jaxlab.kernels import PAGED_KERNELS
    from jaxlab.kernels.paged_pallas import PagedPallas

    def paged(kern: Any) -> AttendFn:
        return lambda q, layer, positions, jax_table: kern.attend_cache(q, layer, positions)

    out: list[tuple[dict[str, Any], AttendFn]] = [
        ({"kernel": "paged_xla", "blocks": "-"}, paged(PAGED_KERNELS["paged_xla"]))
    ]
    if backend != "tpu":
        return out
    for label, blocks in pallas_variants(sweep and not quick):
        out.append(
            ({"kernel": "paged_pallas", "blocks": label}, paged(PagedPallas(blocks, tpu=True)))
        )
    for n in JAX_PAGES_PER_BLOCK_QUICK if quick else JAX_PAGES_PER_BLOCK:
        if table_width % n == 0:
            out.append(({"kernel": "jax_paged", "blocks": f"pages_per_block={n}"}, jax_paged(n)))
    return out


def jax_paged(pages_per_block: int) -> AttendFn:
    """jax's ``paged_attention``: ``q [B, H, D]``, lengths ``position + 1``."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    def attend(q, layer, positions, jax_table):
        out = paged_attention(
            q[:, 0],
            layer.k,
            layer.v,
            positions[:, 0] + 1,
            jax_table,
            pages_per_compute_block=pages_per_block,
        )
        return out[:, None]

    return attend


def inputs(
    batch: int, context: int, ragged: bool, shape: dict[str, Any], seed: int
) -> tuple[Any, ...]:
    """``(q, layer, positions, jax_table, lengths)``: a pool of noise, each row's pages
    shuffled across it, each row at the end of its length (``context``, or drawn from 1
    to it when ``ragged``; ``NO_PAGE`` after a ragged row's pages)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxlab.kernels.paged import PagedLayer

    rng = np.random.default_rng(seed)
    h, kv, d, ps = shape["heads"], shape["kv_heads"], shape["head_dim"], shape["page_size"]
    width = -(-context // ps)
    num_pages = batch * width + SPARE_PAGES
    lengths = rng.integers(1, context + 1, batch) if ragged else np.full(batch, context)
    table = rng.permutation(num_pages)[: batch * width].reshape(batch, width).astype(np.int32)
    for b, n in enumerate(lengths):
        table[b, -(-int(n) // ps) :] = num_pages
    dtype = shape["dtype"]
    pool = (kv, num_pages, ps, d)
    k, v = (jnp.asarray(rng.standard_normal(pool, np.float32), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 1, h, d), np.float32), dtype)
    positions = jnp.asarray(lengths - 1, jnp.int32)[:, None]
    jax_table = jnp.asarray(np.minimum(table, num_pages - 1))
    return q, PagedLayer(k, v, jnp.asarray(table)), positions, jax_table, lengths


@suite(
    "paged-attention",
    needs_peak=True,
    default=False,
    description="decode attention over a paged cache: the kernels alone, GB/s of K/V read",
)
def paged_attention_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax

    from jaxlab.kernels import PAGED_KERNELS
    from jaxlab.kernels.paged_dense import from_head_major

    cfg = ctx.config
    m = cfg.model
    backend = jax.default_backend()
    shape = {
        "heads": m.n_heads,
        "kv_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "page_size": cfg.inference.page_size,
        "dtype": str(cfg.train.precision.compute_dtype),
    }
    if backend != "tpu":
        ctx.status(
            f"paged_pallas and jax's paged_attention left out: Pallas TPU kernels, not on "
            f"{backend} (interpret mode would time the interpreter)"
        )
    reference = jax.jit(PAGED_KERNELS["paged_reference"].attend_cache)
    batches, contexts = QUICK_SHAPES if ctx.quick else SHAPES
    for context in contexts:
        for batch in batches:
            for ragged in (False, True) if batch == max(batches) else (False,):
                args = inputs(batch, context, ragged, shape, cfg.runtime.seed)
                q, layer, positions, jax_table, lengths = args
                want = reference(q, layer, positions)
                # paged_pallas's pool layout, converted once, where paged_pallas runs.
                dense = from_head_major(layer) if backend == "tpu" else layer
                width = layer.table.shape[1]
                sweep = batch == max(batches) and not ragged
                for fields, attend in candidates(backend, ctx.quick, width, sweep):
                    case = {
                        **fields,
                        **shape,
                        "batch": batch,
                        "context": context,
                        "lengths": "ragged" if ragged else "full",
                    }
                    nbytes = kv_bytes(
                        lengths, shape["kv_heads"], shape["head_dim"], q.dtype.itemsize
                    )
                    pool = dense if fields["kernel"] == "paged_pallas" else layer
                    yield _measure(ctx, case, attend, (q, pool, positions, jax_table), want, nbytes)


def looped(attend: AttendFn, calls: int) -> AttendFn:
    """``calls`` back-to-back calls of ``attend`` in one jitted loop, as a decode step's
    layers run: each call's output is the next call's query, and the table rows (with
    their positions) rotate by one each call, so nothing that reads the pool is loop
    invariant (XLA could hoist ``paged_xla``'s page gather out of the loop otherwise).
    Every call reads the same bytes: the rows' lengths only move between rows."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    def run(q, layer, positions, jax_table):
        def body(_, carry):
            q, table, positions, jax_table = carry
            out = attend(q, dataclasses.replace(layer, table=table), positions, jax_table)
            return tuple(jnp.roll(x, 1, axis=0) for x in (out, table, positions, jax_table))

        return jax.lax.fori_loop(0, calls, body, (q, layer.table, positions, jax_table))[0]

    return run


def _measure(
    ctx: BenchContext,
    case: dict[str, Any],
    attend: AttendFn,
    args: tuple[Any, ...],
    want: Any,
    nbytes: int,
) -> Record:
    """One kernel's record: compiled apart; then :data:`CALLS` calls in one jitted loop
    (:func:`looped`) timed as usual, each sample the loop's time over its calls. A lone
    call would time the host's dispatch, tens of microseconds, more than the kernel."""
    import jax
    import jax.numpy as jnp

    from jaxlab.bench.stats import summarize
    from jaxlab.bench.timing import Samples, measure

    metric = "decode_attention_s"
    case = {**case, "calls_per_sample": CALLS}
    ctx.status(f"compiling {case['kernel']} {case['blocks']} B={case['batch']}")
    try:
        out = jax.block_until_ready(jax.jit(attend)(*args))
        t0 = time.perf_counter()
        loop = jax.jit(looped(attend, CALLS)).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(loop(*args))
    except Exception as e:
        return ctx.failure(metric, e, case=case)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
    del out
    ctx.status(f"{metric} {case['kernel']} {case['blocks']} B={case['batch']}")
    loops = measure(lambda: loop(*args), warmup=ctx.warmup(), repeats=ctx.repeats())
    samples = Samples(
        [t / CALLS for t in loops.times_s], loops.warmup, loops.repeats, error=loops.error
    )
    derived: dict[str, Any] = {}
    if samples.ok:
        stats = summarize(samples.times_s, min_samples_for_tails=ctx.min_samples_for_tails)
        median = stats.median_value
        derived = {
            "us": 1e6 * median,
            "compile_s": compile_s,
            "kv_bytes": nbytes,
            "max_abs_diff_vs_reference": diff,
            **ctx.bandwidth(nbytes / median),
        }
    return ctx.record(metric, "s", samples, case=case, derived=derived)
