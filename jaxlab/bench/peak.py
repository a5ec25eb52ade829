"""Suite ``peak``: what this device can do, measured in the same run as everything else.

* matmul throughput for float32 and bfloat16: a jitted ``a @ b`` of two square ``n x n``
  matrices, ``GFLOP/s = 2 n^3 / median time``;
* memory bandwidth: a jitted elementwise ``x + 1`` over a large float32 array (every byte is
  read once and written once), ``GB/s = 2 * bytes / median time``.

Sizes: ``n = 2048`` (``1024`` with --quick) and 256 MiB (64 MiB) on CPU; on an accelerator,
where those finish in microseconds and dispatch overhead would dominate, ``n = 8192``
(``4096``) and 1 GiB (256 MiB). The size is part of the record's case.

The float32 figure (or the one matching a model's compute dtype) is the MFU denominator:
:func:`peak_gflops` reads it back from the records of a run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite

PEAK_SUITE = "peak"
MATMUL_METRIC = "matmul_time"
COPY_METRIC = "copy_time"
MATMUL_DTYPES = ("float32", "bfloat16")


def sizes(backend: str, quick: bool) -> tuple[int, int]:
    """``(matmul n, copy MiB)`` for a backend."""
    if backend == "cpu":
        return (1024, 64) if quick else (2048, 256)
    return (4096, 256) if quick else (8192, 1024)


def peak_gflops(records: Iterable[Record], dtype: str = "float32") -> float | None:
    """The matmul GFLOP/s of ``dtype`` among ``records`` (one run), or None if not measured.

    If a run holds several sizes, the largest ``n`` wins (closest to the device's peak).
    """
    best: tuple[int, float] | None = None
    for r in records:
        if (
            r.suite == PEAK_SUITE
            and r.metric == MATMUL_METRIC
            and r.ok
            and r.case.get("dtype") == dtype
            and isinstance(r.derived.get("gflops"), int | float)
        ):
            n = r.case.get("n")
            cand = (n if isinstance(n, int) else 0, float(r.derived["gflops"]))
            if best is None or cand[0] > best[0]:
                best = cand
    return None if best is None else best[1]


@suite(PEAK_SUITE, description="matmul GFLOP/s (float32, bfloat16) and memory GB/s")
def peak_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    backend = jax.default_backend()
    n, mib = sizes(backend, ctx.quick)
    precision = str(getattr(jax.config, "jax_default_matmul_precision", None) or "default")

    matmul = jax.jit(lambda a, b: a @ b)
    for dtype in MATMUL_DTYPES:
        case = {"op": "matmul", "dtype": dtype, "n": n}
        try:
            # Host-side random data (no compile of a random kernel); normal, not ones,
            # so no value-dependent shortcut can flatter the figure.
            rng = np.random.default_rng(ctx.config.runtime.seed)
            a = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype=dtype)
            b = jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype=dtype)
            jax.block_until_ready((a, b))
        except Exception as e:
            yield ctx.failure(MATMUL_METRIC, e, case=case)
            continue
        flops = 2 * n**3

        def derive(s: Stats, flops: int = flops) -> dict[str, Any]:
            return {"gflops": flops / s.median_value / 1e9, "flops": flops, "precision": precision}

        yield ctx.bench(MATMUL_METRIC, lambda a=a, b=b: matmul(a, b), case=case, derive=derive)
        del a, b

    case = {"op": "copy", "dtype": "float32", "mib": mib}
    try:
        x = jnp.zeros((mib * 2**20 // 4,), dtype=jnp.float32)
        jax.block_until_ready(x)
    except Exception as e:
        yield ctx.failure(COPY_METRIC, e, case=case)
        return
    moved = 2 * x.nbytes  # read once + write once
    copy = jax.jit(lambda v: v + 1.0)
    yield ctx.bench(
        COPY_METRIC,
        lambda: copy(x),
        case=case,
        derive=lambda s: {"gb_per_s": moved / s.median_value / 1e9, "bytes_moved": moved},
    )
