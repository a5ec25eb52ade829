"""Suite ``peak``: what this device can do, measured in the same run as everything else.

* matmul throughput for float32 and bfloat16: a jitted ``a @ b`` of two square ``n x n``
  matrices, ``GFLOP/s = 2 n^3 / median time``;
* memory bandwidth, two ways: a jitted elementwise ``x + 1`` over a large float32 array
  (every byte is read once and written once), ``GB/s = 2 * bytes / median time``; and a
  read alone, a column sum of the same bytes as a ``[rows, 1024]`` bfloat16 matrix
  (``GB/s = bytes / median time``), which is the traffic of a decode step: weights and
  K/V read, almost nothing written. The faster of the two is the measured bandwidth.

Sizes: ``n = 2048`` (``1024`` with --quick) and 256 MiB (64 MiB) on CPU; on an accelerator,
where those finish in microseconds and dispatch overhead would dominate, ``n = 8192`` and
``16384`` (``8192`` alone with --quick) and 1 GiB. The size is part of the record's case.

These are the *measured* peaks: :func:`peak_gflops` and :func:`peak_gb_per_s` read the best
of a run back from its records. Every MFU and bandwidth figure shows them beside the
device's datasheet peak where one is known (:mod:`jaxlab.runtime.datasheet`), which is
then the headline denominator (``docs/benchmarking.md``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite

PEAK_SUITE = "peak"
MATMUL_METRIC = "matmul_time"
COPY_METRIC = "copy_time"
MATMUL_DTYPES = ("float32", "bfloat16")


def sizes(backend: str, quick: bool) -> tuple[tuple[int, ...], int]:
    """``(matmul sizes n, copy MiB)`` for a backend."""
    if backend == "cpu":
        return ((1024,), 64) if quick else ((2048,), 256)
    # An accelerator's matmul at n = 4096 is far from its peak (a v5e: about half).
    return ((8192,), 1024) if quick else ((8192, 16384), 1024)


def best_record(
    records: Iterable[Record], metric: str, figure: str, dtype: str | None = None
) -> Record | None:
    """The ok ``peak`` record of ``metric`` (of ``dtype``) with the highest ``figure``."""
    best: Record | None = None
    for r in records:
        value = r.derived.get(figure)
        if (
            r.suite == PEAK_SUITE
            and r.metric == metric
            and r.ok
            and (dtype is None or r.case.get("dtype") == dtype)
            and isinstance(value, int | float)
            and (best is None or value > best.derived[figure])
        ):
            best = r
    return best


def peak_gflops(records: Iterable[Record], dtype: str = "float32") -> float | None:
    """The best matmul GFLOP/s of ``dtype`` among ``records`` (one run), or None if not
    measured. With several sizes the fastest wins: the peak is what the device reached."""
    r = best_record(records, MATMUL_METRIC, "gflops", dtype)
    return None if r is None else float(r.derived["gflops"])


def peak_gb_per_s(records: Iterable[Record]) -> float | None:
    """The best memory bandwidth (GB/s: a copy's read + write, or a read) among
    ``records``, or None."""
    r = best_record(records, COPY_METRIC, "gb_per_s")
    return None if r is None else float(r.derived["gb_per_s"])


def describe_peak(record: Record) -> str:
    """What a measured peak was, in words: ``bfloat16 matmul n=8192, run R (--quick)``."""
    c = record.case
    if record.metric == MATMUL_METRIC:
        what = f"{c.get('dtype')} matmul n={c.get('n')}"
    elif c.get("op") == "read":
        what = f"{c.get('dtype')} read of {c.get('mib')} MiB (a column sum)"
    else:
        what = f"{c.get('dtype')} copy of {c.get('mib')} MiB (read + write)"
    quick = " (--quick)" if record.derived.get("quick") else ""
    return f"{what}, median of {record.stats.n}, run {record.run_id}{quick}"


@suite(PEAK_SUITE, description="matmul GFLOP/s (float32, bfloat16) and memory GB/s")
def peak_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    backend = jax.default_backend()
    ns, mib = sizes(backend, ctx.quick)
    precision = str(getattr(jax.config, "jax_default_matmul_precision", None) or "default")

    matmul = jax.jit(lambda a, b: a @ b)
    for dtype, n in ((d, n) for d in MATMUL_DTYPES for n in ns):
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
            return {
                "gflops": flops / s.median_value / 1e9,
                "flops": flops,
                "precision": precision,
                "quick": ctx.quick,
            }

        yield ctx.bench(MATMUL_METRIC, lambda a=a, b=b: matmul(a, b), case=case, derive=derive)
        del a, b

    def bandwidth(
        case: dict[str, Any], make: Any, op: Any, passes: int
    ) -> Generator[Record, None, bool]:
        """One memory pass over ``make()``'s array: ``passes`` = 2 for a read and a write of
        every byte, 1 for a read. Returns False if the array could not be made."""
        try:
            x = make()
            jax.block_until_ready(x)
        except Exception as e:
            yield ctx.failure(COPY_METRIC, e, case=case)
            return False
        moved = passes * x.nbytes
        fn = jax.jit(op)
        yield ctx.bench(
            COPY_METRIC,
            lambda: fn(x),
            case=case,
            derive=lambda s: {
                "gb_per_s": moved / s.median_value / 1e9,
                "bytes_moved": moved,
                "quick": ctx.quick,
            },
        )
        return True

    copied = yield from bandwidth(
        {"op": "copy", "dtype": "float32", "mib": mib},
        lambda: jnp.zeros((mib * 2**20 // 4,), dtype=jnp.float32),
        lambda v: v + 1.0,
        passes=2,
    )
    if copied:
        yield from bandwidth(
            {"op": "read", "dtype": "bfloat16", "mib": mib},
            lambda: jnp.ones((mib * 2**20 // 2 // 1024, 1024), dtype=jnp.bfloat16),
            lambda v: jnp.sum(v, axis=0, dtype=jnp.float32),  # 4 KiB written
            passes=1,
        )
