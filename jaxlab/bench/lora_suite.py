"""Suite ``lora``: the train step of LoRA fine-tuning against full fine-tuning, one config.

Cases: ``full`` (every parameter trains, AdamW moments for all of them), then LoRA at rank
8 (:data:`RANK`) on ``q, v`` (the ``train.lora`` default targets) and on every target
(``q, k, v, o, mlp``); ``--quick`` runs the first two. Every case times the same pure, donated step the
trainer runs (:class:`~jaxlab.bench.model_suites.StepRunner`) on random batches of the
configured shape; compile is timed apart, never in the samples.

Each record (metric ``step_time``) carries tokens/s, the compile time, and two exact
counts: ``trainable_params`` and ``optimizer_state_bytes``, summed over the optimizer
state's arrays as they are (no estimate), with the compiled step's memory where XLA
reports it. The LoRA records also carry ``optimizer_state_saving`` (the full case's bytes
over theirs) and ``step_time_ratio`` (their median step over the full case's).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
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
    from jaxlab import kernels
    from jaxlab.bench.model_suites import StepRunner, variant_of
    from jaxlab.config.schema import LoraConfig

    cfg = ctx.config
    t = cfg.train
    full: dict[str, float] = {}
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
            "trainable_params": int(sum(x.size for x in _leaves(runner.state["params"]))),
            "optimizer_state_bytes": tree_bytes(runner.state["opt_state"]),
            "frozen_param_bytes": tree_bytes(runner.frozen),
            **runner.memory(),
        }

        def derive(s: Stats, fixed: dict[str, Any] = fixed, runner: Any = runner) -> dict:
            out = {"tokens_per_s": runner.tokens_per_step / s.median_value, **fixed}
            if full:
                out["optimizer_state_saving"] = full["bytes"] / fixed["optimizer_state_bytes"]
                out["step_time_ratio"] = s.median_value / full["step_s"]
            else:
                full.update(bytes=fixed["optimizer_state_bytes"], step_s=s.median_value)
            return out

        yield ctx.bench("step_time", runner, case=case, derive=derive)
        del runner
        gc.collect()  # this case's state must be gone before the next one allocates


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


__all__ = ["CASES", "LORA_SUITE", "RANK", "tree_bytes"]
