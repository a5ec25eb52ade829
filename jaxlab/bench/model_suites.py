"""Suites over the model itself: ``train`` (tokens/s and MFU vs batch and accumulation)
and ``checkpoint`` (save / restore seconds, and what an async save costs a step).

Both time the same pure, donated train step the trainer runs, on random token batches of
the configured shape (the data pipeline is measured by the ``tokenizer`` suite and is not
on the device's critical path: the loop builds batch s+1 while step s runs).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite
from jaxlab.bench.timing import Samples, measure
from jaxlab.config import JaxlabConfig


def variant_of(cfg: JaxlabConfig) -> str:
    m = cfg.model
    gpt2 = m.mlp == "gelu" and m.positions == "learned" and m.tie_embeddings
    return "gpt2-like" if gpt2 else f"{m.mlp}+{m.positions}{'+tied' if m.tie_embeddings else ''}"


class StepRunner:
    """A compiled train step plus its state and one device batch, ready to be timed.

    With ``lora`` (a :class:`~jaxlab.config.schema.LoraConfig`) the step trains adapters of
    that shape on a frozen base (the model's initial parameters), as a LoRA run does: the
    state holds the adapters and their optimizer state, the base is the step's third
    argument (:attr:`frozen`)."""

    def __init__(self, cfg: JaxlabConfig, batch_size: int, grad_accum_steps: int, lora: Any = None):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from jaxlab.model import lora as lora_math
        from jaxlab.train.optimizer import learning_rate_schedule, make_optimizer
        from jaxlab.train.step import (
            LoraSpec,
            cast_tree,
            init_state,
            initial_params,
            make_train_step,
        )

        t = cfg.train
        graphdef, params = initial_params(cfg.model, t.precision, 0, remat=t.remat)
        master = t.precision.master_dtype is not None
        #: The step's arguments after (state, batch): a LoRA step's frozen base.
        self.frozen: tuple[Any, ...] = ()
        spec = None
        if lora is not None:
            spec = LoraSpec(lora_math.scale_of(lora.alpha, lora.rank), lora.dropout)
            self.frozen = (cast_tree(params, t.precision.param_dtype),)
            params = lora_math.init_weights(cfg.model, lora.rank, lora.targets, jax.random.key(0))
            master = False
        tx = make_optimizer(t)
        step = make_train_step(
            graphdef,
            tx,
            learning_rate_schedule(t),
            grad_accum_steps=grad_accum_steps,
            dropout=cfg.model.dropout_rate > 0,
            lora=spec,
            loss_chunk_tokens=t.loss_chunk_tokens,
        )
        self.jitted = jax.jit(step, donate_argnums=0)
        seq = cfg.data.seq_len
        rng = np.random.default_rng(0)
        toks = rng.integers(0, cfg.model.vocab_size, (batch_size, seq + 1))
        self.batch = {
            "tokens": jnp.asarray(toks[:, :-1], jnp.int32),
            "targets": jnp.asarray(toks[:, 1:], jnp.int32),
            "positions": jnp.tile(jnp.arange(seq, dtype=jnp.int32), (batch_size, 1)),
            "segment_ids": jnp.ones((batch_size, seq), jnp.int32),
            "loss_mask": jnp.ones((batch_size, seq), jnp.float32),
        }
        self.state = init_state(
            params, tx, 0, param_dtype=t.precision.param_dtype if master else None
        )
        del params
        self.tokens_per_step = batch_size * seq

    def compile(self) -> float:
        """Trace, lower and compile the step; returns the total seconds (:attr:`stages`)."""
        t0 = time.perf_counter()
        traced = self.jitted.trace(self.state, self.batch, *self.frozen)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        self.compiled = lowered.compile()
        t3 = time.perf_counter()
        self.stages = {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}
        return t3 - t0

    def memory(self) -> dict[str, Any]:
        """What the compiled step needs (XLA's buffer assignment: arguments, outputs not
        aliased to donated arguments, temporaries), and the device's peak so far."""
        import jax

        out: dict[str, Any] = {}
        try:
            ma = self.compiled.memory_analysis()
        except Exception:  # not every backend reports it
            ma = None
        if ma is not None:
            arg, res = ma.argument_size_in_bytes, ma.output_size_in_bytes
            alias, temp = ma.alias_size_in_bytes, ma.temp_size_in_bytes
            peak = getattr(ma, "peak_memory_in_bytes", 0) or arg + res - alias + temp
            out |= {
                "step_memory_bytes": peak,
                "step_argument_bytes": arg,
                "step_temp_bytes": temp,
            }
        try:
            stats = jax.local_devices()[0].memory_stats()
        except Exception:
            stats = None
        if stats:
            # The process's peak since it started (no per-case reset exists): it only grows.
            out["device_peak_bytes_so_far"] = stats.get("peak_bytes_in_use")
            out["device_bytes_limit"] = stats.get("bytes_limit")
        return out

    def __call__(self) -> Any:
        self.state, metrics = self.compiled(self.state, self.batch, *self.frozen)
        return self.state, metrics


def train_cases(cfg: JaxlabConfig, quick: bool) -> list[tuple[int, int]]:
    b = cfg.train.batch_size
    batches = [b] if quick else sorted({max(b // 2, 1), b, 2 * b})
    cases = [(bs, 1) for bs in batches]
    if b % 2 == 0:
        cases.append((b, 2))
    return cases


def train_record(
    ctx: BenchContext,
    cfg: JaxlabConfig,
    batch: int,
    accum: int,
    before: Callable[[], Any] | None = None,
    warm_each: int = 0,
) -> Record:
    """The train step's record; ``before`` and ``warm_each`` as in ``measure``."""
    from jaxlab import kernels
    from jaxlab.model import flops_per_token

    case = {
        "batch_size": batch,
        "grad_accum_steps": accum,
        "seq_len": cfg.data.seq_len,
        "variant": variant_of(cfg),
        "compute_dtype": cfg.train.precision.compute_dtype,
        "attention_impl": kernels.resolve(cfg.model.attention_impl),
    }
    try:
        runner = StepRunner(cfg, batch, accum)
        compile_s = runner.compile()
    except Exception as e:
        return ctx.failure("step_time", e, case=case)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, training=True)

    def derive(s: Stats) -> dict[str, Any]:
        tps = runner.tokens_per_step / s.median_value
        return {
            "tokens_per_s": tps,
            "compile_s": compile_s,
            **ctx.mfu(fpt * tps, dtype=cfg.train.precision.compute_dtype),
        }

    return ctx.bench(
        "step_time", runner, case=case, derive=derive, before=before, warm_each=warm_each
    )


@suite(
    "train",
    needs_peak=True,
    new_shapes=True,
    description="train-step tokens/s and MFU vs batch and accumulation",
)
def train_suite(ctx: BenchContext) -> Iterator[Record]:
    cfg = ctx.config
    for batch, accum in train_cases(cfg, ctx.quick):
        yield train_record(ctx, cfg, batch, accum)


@suite("checkpoint", description="Orbax save/restore seconds; async save's cost on step time")
def checkpoint_suite(ctx: BenchContext) -> Iterator[Record]:
    import jax

    from jaxlab.checkpoint import Checkpointer
    from jaxlab.train.step import abstract_like

    cfg = ctx.config
    runner = StepRunner(cfg, cfg.train.batch_size, 1)
    runner.compile()
    jax.block_until_ready(runner())
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.state))
    case = {"state_mib": round(n_bytes / 2**20, 2), "batch_size": cfg.train.batch_size}
    root = tempfile.mkdtemp(prefix="jaxlab-ckpt-bench-")
    reps = ctx.repeats(quick_cap=3)
    try:
        step = [0]

        def checkpointer(name: str, async_save: bool) -> Checkpointer:
            return Checkpointer(f"{root}/{name}", every_steps=1, keep_last=2, async_save=async_save)

        def start_save(ck: Checkpointer) -> None:
            step[0] += 1
            ck.save(step[0], runner.state, {"step": step[0]}, force=True)

        def save(name: str, async_save: bool, *, until_durable: bool) -> Samples:
            # Every sample starts with no save in flight: Orbax makes a new save wait for
            # the previous one, and that wait is the previous sample's cost, not this one's.
            ck = checkpointer(name, async_save)

            def one() -> None:
                start_save(ck)
                if until_durable:
                    ck.wait()

            samples = measure(one, warmup=1, repeats=reps, sync=lambda _: None, before=ck.wait)
            ck.close()  # waits for the last save
            return samples

        yield ctx.record(
            "save_s", "s", save("sync", False, until_durable=True), case={**case, "mode": "sync"}
        )
        # The blocking part of an async save: what the training loop waits for.
        yield ctx.record(
            "save_s",
            "s",
            save("async", True, until_durable=False),
            case={**case, "mode": "async (blocking part)"},
        )
        # ... and from the call until the checkpoint is durable (the blocking part included).
        yield ctx.record(
            "save_s",
            "s",
            save("async-durable", True, until_durable=True),
            case={**case, "mode": "async (until durable)"},
        )

        ck = Checkpointer(f"{root}/sync", read_only=True)
        target = abstract_like(runner.state)
        yield ctx.bench(
            "restore_s", lambda: ck.restore("latest", target)[0], case=case, repeats=reps, warmup=1
        )
        ck.close()

        # Step time with and without an async save in flight: the save starts untimed
        # (its blocking part is above), then one step is timed while it writes.
        plain = measure(runner, warmup=1, repeats=reps)
        yield ctx.record("step_time", "s", plain, case={**case, "during": "no save"})
        ck = checkpointer("overlap", True)

        def settle_then_start() -> None:
            ck.wait()
            start_save(ck)

        overlapped = measure(runner, warmup=1, repeats=reps, before=settle_then_start)
        ck.close()
        yield ctx.record(
            "step_time", "s", overlapped, case={**case, "during": "async save in flight"}
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
