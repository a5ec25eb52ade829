"""A quick check that the Pallas paged decode kernels lower with Mosaic and are right on the
chip: one line per shape, ``PASS`` or ``FAIL``, exit code 1 if any failed.

    bash jaxlab/bench/tpu_bench.sh kernels            # on the TPU: this first, then the suite
    PYTHONPATH=$PWD python3 -m jaxlab.bench.tpu_kernel_smoke   # alone (flax installed)

Each shape builds a pool of noise whose rows' pages are shuffled across it (ragged
shapes: lengths from 1 to the context, ``NO_PAGE`` after each row's pages and one page
missing inside a row), runs ``paged_pallas`` (compiled by Mosaic on a TPU; interpret mode
on a CPU, where it checks this script, not Mosaic), and compares it with
``paged_reference``'s math in f32 at the highest matmul precision on the same inputs.
Bound: ``4 u`` of the largest value, ``u = 2^-8``, whatever the dtype (the kernel rounds
its probabilities to the value dtype for the second dot, and on a TPU an f32 dot may run
in bf16 passes). The shapes cover the tpu-small preset (12 heads of 64, MHA, pages of
16, bf16), grouped heads, head_dim 128, kv heads filling less than a lane row, f32,
larger pages, and every knob of :class:`~jaxlab.kernels.paged_plan.PagedBlocks` (small
and lane-sparse blocks, one row per step, three and four buffer slots). The kernel reads
the lane-dense pool (:mod:`jaxlab.kernels.paged_dense`) of the reference's pages. A shape
whose kernel would fall back to ``paged_xla`` (a page size Mosaic cannot tile) fails: the
point is to run the kernel. Then the decode
write (:mod:`jaxlab.kernels.pallas_paged_write`) against ``write_at``'s scatter, which it
must equal bit for bit (:data:`WRITES`). Nothing here imports jax at import time.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

BF16_U = 2.0**-8


@dataclass(frozen=True)
class Shape:
    """One check: ``batch`` rows of ``context`` positions, ``heads`` query heads over
    ``kv_heads``, ``head_dim``, pages of ``page_size``, ``dtype``, ragged or full rows,
    and the kernel's knobs (``PagedBlocks`` keyword arguments)."""

    name: str
    batch: int = 8
    context: int = 512
    heads: int = 12
    kv_heads: int = 12
    head_dim: int = 64
    page_size: int = 16
    dtype: str = "bfloat16"
    ragged: bool = False
    blocks: dict[str, Any] = field(default_factory=dict)


SHAPES = (
    Shape("tpu-small B8 ctx512 full"),
    Shape("tpu-small B8 ctx512 ragged+hole", ragged=True),
    Shape("tpu-small B32 ctx2048 ragged+hole", batch=32, context=2048, ragged=True),
    Shape("tpu-small B1 ctx2048 full", batch=1, context=2048),
    Shape("GQA 12/4 ragged+hole", kv_heads=4, ragged=True),
    Shape("GQA 16/2 head_dim 128 ragged+hole", heads=16, kv_heads=2, head_dim=128, ragged=True),
    Shape("f32 pages of 8 ragged+hole", dtype="float32", page_size=8, ragged=True),
    Shape("pages of 32 ragged+hole", page_size=32, ragged=True),
    Shape("block_tokens=128 ragged+hole", ragged=True, blocks={"block_tokens": 128}),
    Shape("block_tokens=1024 B32", batch=32, context=2048, blocks={"block_tokens": 1024}),
    Shape("one page per block (16 lanes)", ragged=True, blocks={"pages_per_block": 1}),
    Shape("rows_per_step=1 ragged+hole", ragged=True, blocks={"rows_per_step": 1}),
    Shape("rows_per_step=3 (padded rows)", batch=8, ragged=True, blocks={"rows_per_step": 3}),
    Shape("4/2 heads of 32: 64 lanes ragged+hole", heads=4, kv_heads=2, head_dim=32, ragged=True),
    Shape("slots=3 ragged+hole", ragged=True, blocks={"slots": 3}),
    Shape(
        "slots=4 B32 ctx160 ragged+hole", batch=32, context=160, ragged=True, blocks={"slots": 4}
    ),
)


def inputs(shape: Shape, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(q [B, 1, H, D], PagedLayer, positions [B, 1])`` of ``shape``; the layer's pool is
    kv-head major, the reference's layout (``paged_dense.from_head_major`` gives the kernel's)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxlab.kernels.paged import PagedLayer

    rng = np.random.default_rng(seed)
    ps = shape.page_size
    width = -(-shape.context // ps)
    num_pages = shape.batch * width + 4
    lengths = np.full(shape.batch, shape.context)
    table = rng.permutation(num_pages)[: shape.batch * width].reshape(shape.batch, width)
    table = table.astype(np.int32)
    if shape.ragged:
        lengths = rng.integers(1, shape.context + 1, shape.batch)
        lengths[0], lengths[-1] = 1, shape.context
        for b, n in enumerate(lengths):
            table[b, -(-int(n) // ps) :] = num_pages
        table[-1, width // 2] = num_pages  # a page missing inside the last row's length
    pool = (shape.kv_heads, num_pages, ps, shape.head_dim)
    k, v = (jnp.asarray(rng.standard_normal(pool, np.float32), shape.dtype) for _ in range(2))
    q = rng.standard_normal((shape.batch, 1, shape.heads, shape.head_dim), np.float32)
    positions = jnp.asarray(lengths - 1, jnp.int32)[:, None]
    return jnp.asarray(q, shape.dtype), PagedLayer(k, v, jnp.asarray(table)), positions


def check(shape: Shape) -> tuple[bool, str]:
    """``(passed, the shape's line)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlab.kernels import PAGED_KERNELS
    from jaxlab.kernels.paged import PagedLayer
    from jaxlab.kernels.paged_dense import from_head_major
    from jaxlab.kernels.paged_pallas import PagedPallas, runs_pallas
    from jaxlab.kernels.paged_plan import PagedBlocks

    backend = jax.default_backend()
    if not runs_pallas(1, shape.page_size, shape.dtype, backend, tpu=True):
        return False, f"FAIL {shape.name}: the kernel would not run here (paged_xla fallback)"
    q, layer, positions = inputs(shape)
    dense = from_head_major(layer)
    kern = PagedPallas(PagedBlocks(**shape.blocks), tpu=True)
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(kern.attend_cache).lower(q, dense, positions).compile()
        compile_s = time.perf_counter() - t0
        got = np.asarray(jax.block_until_ready(compiled(q, dense, positions)), np.float32)
    except Exception as e:  # a Mosaic lowering error is what this script is for
        text = f"{type(e).__name__}: {e}".replace("\n", " ")
        return False, f"FAIL {shape.name}: {text[:2000]}"

    f32 = jnp.float32
    up = PagedLayer(layer.k.astype(f32), layer.v.astype(f32), layer.table)
    with jax.default_matmul_precision("highest"):
        want = PAGED_KERNELS["paged_reference"].attend_cache(q.astype(f32), up, positions)
    want = np.asarray(want)
    err = float(np.max(np.abs(got - want)))
    bound = 4 * BF16_U * float(np.max(np.abs(np.asarray(up.v))))
    ok = bool(np.isfinite(got).all()) and err <= bound
    verdict = "PASS" if ok else "FAIL"
    return ok, f"{verdict} {shape.name}: max |diff| {err:.2e} (bound {bound:.2e}), " + (
        f"compile {compile_s:.2f}s on {backend}"
    )


#: The decode write's checks: ``(name, batch, page_size, dtype)``, tpu-small's 12 heads of 64.
WRITES = (
    ("write tpu-small B1", 1, 16, "bfloat16"),
    ("write tpu-small B32 with skipped rows", 32, 16, "bfloat16"),
    ("write B40: two grid steps, padded rows", 40, 16, "bfloat16"),
    ("write f32 pages of 8", 8, 8, "float32"),
)


def check_write(name: str, batch: int, page_size: int, dtype: str) -> tuple[bool, str]:
    """The Pallas decode write (:mod:`jaxlab.kernels.pallas_paged_write`) into a lane-dense
    pool against ``write_at``'s scatter into the kv-head-major one, on the same chip: equal
    bit for bit, or it fails. Rows write at random positions of shuffled pages; every
    fifth row is done (``NO_SLOT``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlab.kernels import NO_SLOT
    from jaxlab.kernels import paged as pg
    from jaxlab.kernels.paged_dense import from_head_major, to_head_major
    from jaxlab.kernels.paged_pallas import PagedPallas

    rng = np.random.default_rng(batch)
    width, n_kv, d = 512 // page_size, 12, 64
    num_pages = batch * width + 4
    table = rng.permutation(num_pages)[: batch * width].reshape(batch, width)
    positions = rng.integers(0, 512, batch)
    positions[::5] = NO_SLOT
    pool = (n_kv, num_pages, page_size, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((batch, 1, n_kv, d)), dtype) for _ in range(2))
    layer = pg.PagedLayer(k_pool, v_pool, jnp.asarray(table, jnp.int32))
    dense = from_head_major(layer)
    start = jnp.asarray(positions, jnp.int32)
    kern = PagedPallas(tpu=True, tpu_write=True)
    try:
        t0 = time.perf_counter()
        compiled = jax.jit(kern.write).lower(dense, k, v, start).compile()
        compile_s = time.perf_counter() - t0
        got = to_head_major(jax.block_until_ready(compiled(dense, k, v, start)))
    except Exception as e:  # a Mosaic lowering error is what this script is for
        text = f"{type(e).__name__}: {e}".replace("\n", " ")
        return False, f"FAIL {name}: {text[:2000]}"
    want = jax.jit(pg.write)(layer, k, v, start)
    ok = all(
        np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        for a, b in ((got.k, want.k), (got.v, want.v))
    )
    verdict = "PASS" if ok else "FAIL"
    return ok, f"{verdict} {name}: {'equal to' if ok else 'differs from'} the scatter, " + (
        f"compile {compile_s:.2f}s on {jax.default_backend()}"
    )


def main(argv: list[str] | None = None) -> int:
    import jax

    del argv
    print(f"jax {jax.__version__} on {jax.devices()}", flush=True)
    failed = 0
    for shape in SHAPES:
        ok, line = check(shape)
        failed += not ok
        print(line, flush=True)
    for write in WRITES:
        ok, line = check_write(*write)
        failed += not ok
        print(line, flush=True)
    total = len(SHAPES) + len(WRITES)
    print(f"{total - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
