"""Suites over the inference engine: ``prefill`` (latency vs prompt length, bucketed vs
exact shapes), ``decode`` (latency and tokens/s vs batch) and ``kv-cache`` (cached vs naive
vs generated length).

Engines are randomly initialised at the configured model shape (throughput does not
depend on the weights); every timed sample runs after warm-up has compiled everything,
and the records carry the compile counts so a compile inside a timed call is visible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxlab.bench import speculative
from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.speculative import speculative_cases
from jaxlab.bench.suites import suite
from jaxlab.config import JaxlabConfig


def _engine(cfg: JaxlabConfig, buckets: list[int] | None = None) -> Any:
    from jaxlab.infer.engine import Engine

    if buckets is not None:
        cfg = cfg.model_copy(deep=True)
        cfg.inference.prefill_buckets = buckets
    return Engine.from_config(cfg, seed=0)


def _max_len(cfg: JaxlabConfig) -> int:
    return cfg.inference.max_len or cfg.model.max_seq_len


def loop_case(engine: Any) -> dict[str, int]:
    """``decode_unroll`` where the config sets the decode loop's steps per trip; nothing when
    the platform chooses (``runtime/tuning.py``), so those records keep their cases."""
    given = engine.cfg.inference.decode_unroll
    return {} if given is None else {"decode_unroll": given}


def int8_case(engine: Any) -> dict[str, str]:
    """What an int8 engine's records add to their case (``inference.weights``,
    ``activations``, ``kv_cache_dtype``); nothing for a float engine, so float records keep
    the cases earlier runs have."""
    inf = engine.cfg.inference
    out = {}
    if inf.weights == "int8":
        out["weights"] = "int8"
        if inf.activations == "int8":
            out["activations"] = "int8"
    if inf.kv_cache_dtype == "int8":
        out["kv_cache_dtype"] = "int8"
    return out


def generation_record(
    ctx: BenchContext,
    engine: Any,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    kv_cache: bool,
    extra: dict[str, Any] | None = None,
    before: Callable[[], Any] | None = None,
    warm_each: int = 0,
) -> Record:
    from jaxlab.infer.measure import measure_generate
    from jaxlab.model import flops_per_token

    case = {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "kv_cache": kv_cache,
        **(extra or {}),
        **int8_case(engine),
        **loop_case(engine),
    }
    ctx.status(f"generate {case}")
    try:
        r = measure_generate(
            engine,
            batch,
            prompt_len,
            new_tokens,
            kv_cache=kv_cache,
            repeats=ctx.repeats(quick_cap=3),
            warmup=1,
            before=before,
            warm_each=warm_each,
        )
    except Exception as e:
        return ctx.failure("generate_s", e, case=case)
    fwd = flops_per_token(engine.cfg.model, prompt_len + new_tokens, training=False)
    derived = {
        "tokens_per_s": r["tokens_per_s"],
        "decode_tokens_per_s": r["decode_tokens_per_s"],
        "per_token_latency_ms": 1e3 * r["decode_s"] / max(new_tokens - 1, 1),
        "prefill_s": r["prefill_s"],
        "compiles": r["compiles"],
        "recompiles_while_timed": r["recompiles_while_timed"],
        **ctx.mfu(fwd * r["tokens_per_s"], dtype=engine.compute_dtype),
    }
    if kv_cache and new_tokens > 1 and r["decode_s"] > 0:
        derived |= decode_bytes(ctx, engine, batch, prompt_len, new_tokens, r["decode_s"])
    if ctx.profile:
        from jaxlab.infer import offline
        from jaxlab.infer.measure import generation_requests

        requests = generation_requests(engine, batch, prompt_len, new_tokens)
        derived |= ctx.profile_call(
            lambda: offline.generate(engine, requests, kv_cache=kv_cache),
            "generate_s",
            sync=lambda out: out,  # generate returns once the tokens are on the host
        )
    return ctx.record("generate_s", "s", r["wall_s"], case=case, derived=derived)


def step_bytes(engine: Any, batch: int, prompt_len: int, new_tokens: int) -> tuple[int, float]:
    """``(weights, kv)``: the bytes a decode step of a ``generate`` call must read.

    A step reads the step's weights once whatever the batch (``Engine.step_weight_bytes``)
    and, per row, the K and V of every position it attends to: the prompt and the tokens
    before it, ``prompt_len + new_tokens / 2`` positions on average over the call's
    ``new_tokens - 1`` decode steps.
    """
    per_position = engine.cache_bytes_per_slot / engine.max_len
    return engine.step_weight_bytes, batch * (prompt_len + new_tokens / 2) * per_position


def decode_bytes(
    ctx: BenchContext, engine: Any, batch: int, prompt_len: int, new_tokens: int, decode_s: float
) -> dict[str, Any]:
    """Bytes a decode step reads and the rate it reads them at (docs/benchmarking.md).

    ``bytes_per_step`` is :func:`step_bytes`' sum, the least a step must read, as model
    FLOPs are the least it must compute. The measured step is ``decode_s`` (one jitted loop
    of every decode step, timed to its tokens on the host) over its ``new_tokens - 1``
    steps. ``kv_cache_bytes`` is the whole cache the batch holds (``max_len`` positions a
    row), which MaxText's "AR memory bandwidth" counts instead.
    """
    step_s = decode_s / (new_tokens - 1)
    weights, kv = step_bytes(engine, batch, prompt_len, new_tokens)
    total = weights + kv
    return {
        "step_s": step_s,
        "bytes_per_step": total,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": kv,
        "kv_cache_bytes": batch * engine.cache_bytes_per_slot,
        **ctx.bandwidth(total / step_s),
    }


@suite(
    "decode",
    needs_peak=True,
    new_shapes=True,
    check=speculative.check,
    description="decode latency and tokens/s vs batch size (and speculative decoding's cases,"
    " given bench.speculative_run_dir)",
)
def decode_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax

    cfg = ctx.config
    engine = _engine(cfg)
    cap = _max_len(cfg)
    prompt, new = min(32, cap // 4), min(128, cap // 2)
    if ctx.quick:
        new = min(new, 32)
    if cfg.bench.decode_batches is not None:
        batches = list(cfg.bench.decode_batches)
    elif jax.default_backend() == "cpu":
        batches = [1, 8] if ctx.quick else [1, 4, 8, 16]
    else:  # an accelerator's step barely grows with rows: up to 32 (the target)
        batches = [1, 8, 32] if ctx.quick else [1, 4, 8, 16, 32]
    first_step: float | None = None
    for batch in batches:
        rec = generation_record(ctx, engine, batch, prompt, new, kv_cache=True)
        step = rec.derived.get("step_s")
        if batch == 1 and isinstance(step, float):
            first_step = step
        elif first_step is not None and isinstance(step, float):
            # How a step's time grows with rows: this step over the batch-1 step, same run.
            rec = rec.model_copy(
                update={"derived": {**rec.derived, "step_vs_batch1": step / first_step}}
            )
        yield rec
    if cfg.bench.speculative_run_dir is not None:  # else: the speculative suite, on request
        yield from speculative_cases(ctx, engine)


@suite(
    "kv-cache",
    new_shapes=True,
    description="cached vs naive (full-prefix) generation vs generated length",
)
def kv_cache_suite(ctx: BenchContext) -> Iterator[Record]:
    cfg = ctx.config
    engine = _engine(cfg)
    cap = _max_len(cfg)
    prompt = min(32, cap // 4)
    lengths = [16, 32] if ctx.quick else [32, 64, 128]
    for new in [n for n in lengths if prompt + n <= cap]:
        for kv in (True, False):
            yield generation_record(ctx, engine, 8, prompt, new, kv_cache=kv)


class _Prefiller:
    """One prompt's prefill at a time into one decode state, whose pages every call
    rewrites (the state is donated to each call and replaced by its result)."""

    def __init__(self, engine: Any, sampling: Any) -> None:
        self.engine = engine
        self.sampling = sampling
        self.state = engine.init_decode_state(1)
        self.pages = list(range(engine.max_pages))

    def __call__(self, prompt: list[int]) -> Any:
        from jaxlab.infer.chunks import Chunk

        chunk = Chunk(prompt, 0, self.pages, self.sampling)
        self.state, pre = self.engine.prefill(self.state, [chunk])
        return pre.tokens


@suite(
    "prefill",
    new_shapes=True,
    description="prefill latency vs prompt length; bucketed vs exact shapes",
)
def prefill_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax
    import numpy as np

    from jaxlab.infer.sampling import SamplingParams

    cfg = ctx.config
    cap = _max_len(cfg)
    lengths = sorted(
        {
            max(1, int(cap * f))
            for f in ((0.1, 0.3, 0.5) if ctx.quick else (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9))
        }
    )
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for mode in ("bucketed", "exact"):
        engine = _engine(cfg, None if mode == "bucketed" else sorted(set(lengths)))
        prefill = _Prefiller(engine, sp)
        t0 = time.perf_counter()
        compile_before = engine.compiles["prefill"]
        for n in lengths:  # the sweep a stream of prompt lengths costs, compiles included
            prompt = rng.integers(0, cfg.model.vocab_size, n).tolist()
            jax.block_until_ready(prefill(prompt))
        sweep_s = time.perf_counter() - t0
        yield ctx.record(
            "sweep_s",
            "s",
            [sweep_s],
            case={"mode": mode, "distinct_lengths": len(lengths)},
            derived={
                "prefill_compiles": engine.compiles["prefill"] - compile_before,
                "buckets": list(engine.buckets),
            },
        )
        for n in lengths:
            prompt = rng.integers(0, cfg.model.vocab_size, n).tolist()
            case = {"mode": mode, "prompt_len": n, "bucket": engine.bucket_for(n)}
            yield ctx.bench(
                "prefill_s",
                lambda p=prompt, f=prefill: f(p),
                case=case,
                repeats=ctx.repeats(quick_cap=5),
                warmup=1,
                derive=lambda s, n=n: {"prompt_tokens_per_s": n / s.median_value},
            )
