"""Suite ``lora``: the train step of LoRA fine-tuning against full fine-tuning, one config.

Cases: ``full`` (every parameter trains, AdamW moments for all of them), then LoRA at rank
8 (:data:`RANK`) on ``q, v`` (the ``train.lora`` default targets) and on every target
(``q, k, v, o, mlp``); ``--quick`` runs the first two. Every case times the same pure,
donated step the trainer runs (:class:`~jaxlab.bench.model_suites.StepRunner`) on random
batches of the configured shape; compile is timed apart, never in the samples.

The cases are compared with each other, so they are timed *interleaved*: every case is
compiled and warmed up first, then each round times one step of every case in turn. On a
machine shared with other work a slow spell then falls on all cases alike, where timing them
one after the other would hand it to whichever case ran during it. The cost: every case's
state is alive at once (one model's parameters and moments, plus small adapters).

Each record (metric ``step_time``) carries tokens/s, the compile time, and two exact
counts: ``trainable_params`` and ``optimizer_state_bytes``, summed over the optimizer
state's arrays as they are (no estimate), with the compiled step's memory where XLA
reports it. The LoRA records also carry ``optimizer_state_saving`` (the full case's bytes
over theirs) and ``step_time_ratio`` (their median step over the full case's).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.suites import suite
from jaxlab.config.schema import LoraTarget

LORA_SUITE = "lora"
#: The LoRA rank the suite compares against full fine-tuning (the issue's).
RANK = 8
#: ``(case name, targets)``; None = full fine-tuning.
CASES: tuple[tuple[str, tuple[LoraTarget, ...] | None], ...] = (
    ("full", None),
    ("lora-qv", ("q", "v")),
    ("lora-all", ("q", "k", "v", "o", "mlp")),
)


def tree_bytes(tree: Any) -> int:
    """The bytes of every array in ``tree``, exactly (``size * itemsize``)."""
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


@suite(
    LORA_SUITE,
    needs_peak=False,
    default=False,
    description="LoRA (rank 8) vs full fine-tuning: train tokens/s and optimizer-state bytes",
)
def lora_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax

    from jaxlab import kernels
    from jaxlab.bench.model_suites import StepRunner, variant_of
    from jaxlab.bench.stats import summarize
    from jaxlab.bench.timing import Samples
    from jaxlab.config.schema import LoraConfig

    cfg = ctx.config
    t = cfg.train
    ready: list[tuple[dict[str, Any], StepRunner, dict[str, Any]]] = []
    for name, targets in CASES if not ctx.quick else CASES[:2]:
        lora = None if targets is None else LoraConfig(rank=RANK, targets=list(targets))
        case = {
            "case": name,
            "rank": 0 if lora is None else RANK,
            "targets": "all params" if targets is None else ",".join(targets),
            "batch_size": t.batch_size,
            "grad_accum_steps": t.grad_accum_steps,
            "seq_len": cfg.data.seq_len,
            "variant": variant_of(cfg),
            "compute_dtype": t.precision.compute_dtype,
            "attention_impl": kernels.resolve(cfg.model.attention_impl),
        }
        ctx.status(f"compiling {name}")
        try:
            runner = StepRunner(cfg, t.batch_size, t.grad_accum_steps, lora=lora)
            compile_s = runner.compile()
        except Exception as e:
            yield ctx.failure("step_time", e, case=case)
            continue
        fixed: dict[str, Any] = {
            "compile_s": compile_s,
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(runner.state["params"]))),
            "optimizer_state_bytes": tree_bytes(runner.state["opt_state"]),
            "frozen_param_bytes": tree_bytes(runner.frozen),
            **runner.memory(),
        }
        ready.append((case, runner, fixed))

    warmup, repeats = ctx.warmup(), ctx.repeats()
    times: list[list[float]] = [[] for _ in ready]
    errors: list[str | None] = [None for _ in ready]
    ctx.status(f"timing {len(ready)} cases interleaved, {repeats} rounds")
    for round_ in range(-warmup, repeats):
        for i, (_, runner, _) in enumerate(ready):
            if errors[i] is not None:
                continue
            try:
                t0 = time.perf_counter()
                jax.block_until_ready(runner())
                if round_ >= 0:
                    times[i].append(time.perf_counter() - t0)
            except Exception as e:
                errors[i] = f"{type(e).__name__}: {e} during round {round_}"

    full: dict[str, float] = {}
    for (case, runner, fixed), ts, err in zip(ready, times, errors, strict=True):
        samples = Samples(ts, warmup, repeats, error=err)
        derived: dict[str, Any] = {}
        if err is None:
            median = summarize(ts, min_samples_for_tails=ctx.min_samples_for_tails).median_value
            derived = {"tokens_per_s": runner.tokens_per_step / median, **fixed}
            if case["case"] == "full":
                full.update(bytes=fixed["optimizer_state_bytes"], step_s=median)
            elif full:
                derived["optimizer_state_saving"] = full["bytes"] / fixed["optimizer_state_bytes"]
                derived["step_time_ratio"] = median / full["step_s"]
        yield ctx.record("step_time", "s", samples, case=case, derived=derived)


__all__ = ["CASES", "LORA_SUITE", "RANK", "tree_bytes"]
