"""Compile time measured apart from run time, with JAX's ahead-of-time API.

:func:`time_aot` splits the life of a jitted function into its stages::

    traced   = jax.jit(f).trace(*args)     # Python -> jaxpr
    lowered  = traced.lower()              # jaxpr -> StableHLO
    compiled = lowered.compile()           # StableHLO -> executable (XLA)
    compiled(*args)                        # first call of the executable
    compiled(*args)  x N                   # steady state (warm-up, then timed)

and reports the first call against the steady-state median (``first_call / steady``).
Every repetition starts from ``jax.clear_caches()`` and a fresh function object, so no
stage is served from JAX's in-memory caches. (A persistent compilation cache, if one is
configured, is not cleared; the record says whether one was.)

:func:`time_new_shape` is the cost of a new input shape: a jitted function already
compiled and run for ``args`` is called for the first time with ``new_args`` — the retrace,
recompile and run a user pays when an unseen shape arrives.

Suite ``compile`` applies both to a small jitted MLP (later: the model).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import median
from jaxlab.bench.suites import suite
from jaxlab.bench.timing import Samples, block_until_ready, describe_error, measure

PHASES = ("trace", "lower", "compile", "first_call")


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object calling ``fn``: a cache keyed on the function misses."""

    def fresh(*args: Any) -> Any:
        return fn(*args)

    return fresh


def _clear_caches() -> None:
    import jax

    jax.clear_caches()


@dataclass
class AotTimings:
    """Per-stage samples (seconds); a failure in any stage is set on every stage."""

    trace: Samples = field(default_factory=Samples)
    lower: Samples = field(default_factory=Samples)
    compile: Samples = field(default_factory=Samples)
    first_call: Samples = field(default_factory=Samples)
    steady: Samples = field(default_factory=Samples)
    cost_analysis_flops: float | None = None

    def phases(self) -> dict[str, Samples]:
        return {name: getattr(self, name) for name in PHASES}

    @property
    def first_over_steady(self) -> float | None:
        """Median first call over median steady-state call."""
        if not (self.first_call.ok and self.steady.ok):
            return None
        if not self.first_call.times_s or not self.steady.times_s:
            return None
        steady = median(self.steady.times_s)
        return median(self.first_call.times_s) / steady if steady > 0 else None


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, Sequence) and cost:  # older jax: one dict per device
        cost = cost[0]
    value = cost.get("flops") if isinstance(cost, dict) else None
    return float(value) if isinstance(value, int | float) else None


def time_aot(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    repeats: int,
    steady_warmup: int,
    steady_repeats: int,
    clear_caches: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> AotTimings:
    """Time trace, lower, compile and the first call ``repeats`` times, then the steady state."""
    import jax

    out = AotTimings()
    for s in (out.trace, out.lower, out.compile, out.first_call):
        s.repeats = repeats
    compiled: Any = None
    where = "trace"
    try:
        for _ in range(repeats):
            if clear_caches:
                _clear_caches()
            jitted = jax.jit(_fresh(fn))
            where = "trace"
            t0 = clock()
            traced = jitted.trace(*args)
            t1 = clock()
            where = "lower"
            lowered = traced.lower()
            t2 = clock()
            where = "compile"
            compiled = lowered.compile()
            t3 = clock()
            where = "first call"
            block_until_ready(compiled(*args))
            t4 = clock()
            out.trace.times_s.append(t1 - t0)
            out.lower.times_s.append(t2 - t1)
            out.compile.times_s.append(t3 - t2)
            out.first_call.times_s.append(t4 - t3)
    except Exception as e:
        error = f"{describe_error(e)} during {where}"
        for s in (out.trace, out.lower, out.compile, out.first_call, out.steady):
            s.error = error
        return out
    out.cost_analysis_flops = _flops(compiled)
    out.steady = measure(
        lambda: compiled(*args), warmup=steady_warmup, repeats=steady_repeats, clock=clock
    )
    return out


def time_new_shape(
    fn: Callable[..., Any],
    args: Sequence[Any],
    new_args: Sequence[Any],
    *,
    repeats: int,
    steady_warmup: int,
    steady_repeats: int,
    clear_caches: bool = True,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Samples, Samples]:
    """``(first call with new_args, steady state with new_args)`` after ``args`` was compiled."""
    import jax

    first = Samples(repeats=repeats)
    jitted: Any = None
    try:
        for _ in range(repeats):
            if clear_caches:
                _clear_caches()
            jitted = jax.jit(_fresh(fn))
            block_until_ready(jitted(*args))  # compiled and run for the first shape
            block_until_ready(jitted(*args))
            t0 = clock()
            block_until_ready(jitted(*new_args))
            first.times_s.append(clock() - t0)
    except Exception as e:
        first.error = f"{describe_error(e)} during the new-shape call"
        return first, Samples.failed(first.error)
    steady = measure(
        lambda: jitted(*new_args), warmup=steady_warmup, repeats=steady_repeats, clock=clock
    )
    return first, steady


# --------------------------------------------------------------------------- suite

MLP = {"depth": 4, "d_in": 256, "hidden": 1024, "batch": 64}
NEW_BATCH = 128


def mlp_layers(d_in: int, hidden: int, depth: int) -> list[tuple[int, int]]:
    dims = [d_in, *([hidden] * (depth - 1)), d_in]
    return list(itertools.pairwise(dims))


def mlp_flops(batch: int, d_in: int, hidden: int, depth: int) -> int:
    """Matmul FLOPs of one forward call (a multiply-add counts 2)."""
    return sum(2 * batch * i * o for i, o in mlp_layers(d_in, hidden, depth))


def _mlp(params: Any, x: Any) -> Any:
    import jax

    h = x
    for w, b in params[:-1]:
        h = jax.nn.gelu(h @ w + b)
    w, b = params[-1]
    return h @ w + b


@suite(
    "compile",
    needs_peak=True,
    description="trace/lower/compile time, first call vs steady state, cost of a new shape",
)
def compile_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    depth, d_in, hidden, batch = MLP["depth"], MLP["d_in"], MLP["hidden"], MLP["batch"]
    # Host-side random data: jax.random would compile a kernel per shape before we start.
    rng = np.random.default_rng(ctx.config.runtime.seed)

    def normal(*shape: int, scale: float = 1.0) -> Any:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)

    params = [
        (normal(i, o, scale=i**-0.5), jnp.zeros((o,), jnp.float32))
        for i, o in mlp_layers(d_in, hidden, depth)
    ]
    x = normal(batch, d_in)
    x_new = normal(NEW_BATCH, d_in)
    case = {"fn": "mlp", **MLP, "dtype": "float32"}
    repeats = ctx.repeats()

    ctx.status(f"AOT stages of the MLP x{repeats}")
    aot = time_aot(
        _mlp,
        (params, x),
        repeats=repeats,
        steady_warmup=ctx.warmup(),
        steady_repeats=repeats,
    )
    persistent = bool(getattr(jax.config, "jax_compilation_cache_dir", None))
    for name, samples in aot.phases().items():
        derived: dict[str, Any] = {}
        if name == "compile":
            derived["persistent_compilation_cache"] = persistent
        if name == "first_call":
            derived["first_over_steady"] = aot.first_over_steady
        yield ctx.record(f"{name}_time", "s", samples, case=case, derived=derived)

    flops = mlp_flops(batch, d_in, hidden, depth)
    steady_derived: dict[str, Any] = {}
    if aot.steady.ok and aot.steady.times_s:
        per_s = flops / median(aot.steady.times_s)
        steady_derived = {
            "model_flops": flops,
            "xla_flops": aot.cost_analysis_flops,
            "gflops": per_s / 1e9,
            **ctx.mfu(per_s, dtype="float32"),
        }
    yield ctx.record("steady_call_time", "s", aot.steady, case=case, derived=steady_derived)

    ctx.status(f"first call with a new shape (batch {batch} -> {NEW_BATCH}) x{repeats}")
    first, steady = time_new_shape(
        _mlp,
        (params, x),
        (params, x_new),
        repeats=repeats,
        steady_warmup=ctx.warmup(),
        steady_repeats=repeats,
    )
    new_case = {**case, "new_batch": NEW_BATCH}
    ratio = None
    if first.ok and steady.ok and steady.times_s:
        ratio = median(first.times_s) / median(steady.times_s)
    yield ctx.record(
        "new_shape_first_call_time",
        "s",
        first,
        case=new_case,
        derived={"first_over_steady": ratio},
    )
    yield ctx.record("new_shape_steady_call_time", "s", steady, case=new_case)
