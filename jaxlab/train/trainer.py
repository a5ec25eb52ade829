"""The training loop: run directory, tokenizer, data, model, step, checkpoints, signals.

The loop's only host syncs are the metrics fetch every ``train.log_every_steps`` (one
``device_get`` of the pending steps' scalars) and the checkpoint saves. Everything else
is dispatched asynchronously, so the host prepares batch ``s+1`` while the device runs
step ``s``.

A run started from another (``train.init_from``, :mod:`jaxlab.train.base`) takes its
parameters from that base: all of them train (full fine-tuning), or, with ``train.lora``,
only adapters on them, the base held frozen beside the state (:mod:`jaxlab.train.step`).

``--steps N`` (``Trainer.run(stop_at=N)``) is where a run *stops*; the learning-rate
schedule always spans ``train.steps``. That is what makes ``train --steps 10`` followed by
``resume --steps 20`` equal to ``train --steps 20``.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlab.checkpoint import Checkpointer, Restored
from jaxlab.config import JaxlabConfig
from jaxlab.data import TrainLoader, eval_batches, iter_documents, prepare
from jaxlab.data.cache import default_cache_dir
from jaxlab.model import flops_per_token, lora_flops_per_token, make_model, split_model
from jaxlab.model import lora as lora_math
from jaxlab.model.quant import Activations
from jaxlab.parallel import build_mesh, check_model_fits, describe_mesh, place_batch
from jaxlab.parallel.distributed import barrier, is_primary
from jaxlab.parallel.rules import param_shardings, state_shardings
from jaxlab.runtime.compiled import ShapeKeyedJit
from jaxlab.runtime.datasheet import datasheet_for
from jaxlab.runtime.peak import matmul_peak_gflops
from jaxlab.tokenizer import Tokenizer, bpe_tokenizer, byte_tokenizer
from jaxlab.train import base as base_run
from jaxlab.train.optimizer import learning_rate_schedule, make_optimizer
from jaxlab.train.run_dir import RunDir, run_identity
from jaxlab.train.step import (
    LoraSpec,
    TrainState,
    abstract_like,
    cast_tree,
    init_state,
    initial_params,
    make_eval_step,
    make_train_step,
)

log = logging.getLogger("jaxlab.train")


class Preempted(Exception):
    """SIGINT/SIGTERM arrived; the state was saved at ``step``."""

    def __init__(self, signum: int, step: int, run_dir: Path):
        self.signum = signum
        self.step = step
        self.run_dir = run_dir
        name = signal.Signals(signum).name
        super().__init__(
            f"{name}: saved step {step}; resume with: jaxlab resume --run-dir {run_dir}"
        )


class NonFiniteError(Exception):
    """The loss or gradient norm went non-finite under the 'abort' policy."""


class TrainObserver(Protocol):
    """Hooks for views (the CLI's Rich live view). Subclass to inherit no-op defaults."""

    def on_start(self, trainer: Trainer, start_step: int, stop_at: int) -> None:
        return None

    def on_dispatch(self, step: int) -> None:
        return None

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        return None

    def on_checkpoint(self, step: int) -> None:
        return None

    def on_event(self, message: str) -> None:
        return None


class _NoObserver(TrainObserver):
    pass


@dataclass
class TrainSummary:
    run_dir: str
    steps: int
    start_step: int
    final_loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    compile_s: float | None
    checkpoints: list[int]
    skipped_steps: int
    eval: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "steps": self.steps,
            "start_step": self.start_step,
            "final_loss": self.final_loss,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "compile_s": self.compile_s,
            "checkpoints": self.checkpoints,
            "skipped_steps": self.skipped_steps,
            "eval": self.eval,
            **self.extra,
        }


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(cfg: JaxlabConfig) -> Tokenizer:
    """Load ``tokenizer.path`` or learn one from the configured corpus."""
    t = cfg.tokenizer
    if t.path:
        return Tokenizer.load(t.path)
    if t.kind == "byte":
        return byte_tokenizer(chat=t.chat_tokens)

    def head() -> Iterator[str]:
        budget = t.train_bytes
        for doc in iter_documents(cfg.data):
            if budget <= 0:
                return
            yield doc
            budget -= len(doc.encode("utf-8"))

    return bpe_tokenizer(head(), t.vocab_size, chat=t.chat_tokens)


def tokenizer_for_run(cfg: JaxlabConfig, run_dir: RunDir) -> Tokenizer:
    if (run_dir.tokenizer_dir / "tokenizer.json").is_file():
        return Tokenizer.load(run_dir.tokenizer_dir)
    tok = build_tokenizer(cfg)
    tok.save(run_dir.tokenizer_dir)
    return tok


def tokenizer_files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------- trainer


class Trainer:
    def __init__(
        self,
        cfg: JaxlabConfig,
        run_dir: str | Path,
        *,
        observer: TrainObserver | None = None,
        progress: Any = None,
    ):
        self.cfg = cfg
        self.run_dir = RunDir(run_dir)
        self.observer: TrainObserver = observer or _NoObserver()
        self._progress = progress
        self._signal: int | None = None

        # Only process 0 writes the run directory; the others wait, then read it.
        self.primary = is_primary()
        new_run = not self.run_dir.exists()
        barrier("jaxlab-run-dir-checked")
        t = cfg.train
        #: The base this run started from (``train.init_from``), and its config.
        self.base: base_run.BaseRef | None = None
        base_cfg: JaxlabConfig | None = None
        if t.init_from is not None:
            if new_run:
                self.base, base_cfg = base_run.resolve(t.init_from)
            else:
                self.base = base_run.read_record(self.run_dir.path)
                if t.lora is not None:
                    base_cfg = base_run.resolve(self.base.run_dir, self.base.step)[1]
            if base_cfg is not None and base_cfg.model != cfg.model:
                raise ValueError(
                    f"train.init_from {t.init_from}: its model section differs from this "
                    "run's; a run started from a base takes the base's (train.base.adopt)"
                )
        if new_run and self.primary:
            self.run_dir.create(cfg)
            if self.base is not None:
                base_run.write_record(self.run_dir.path, self.base)
                base_run.copy_tokenizer(self.base, self.run_dir.path)
        elif not new_run and not self.run_dir.holds(cfg):
            raise ValueError(
                f"{self.run_dir.path} holds a different config; use a new --run-dir or "
                f"'jaxlab resume --run-dir {self.run_dir.path}'"
            )
        cache_dir = (
            Path(cfg.data.cache_dir)
            if cfg.data.cache_dir
            else default_cache_dir(cfg.data, cfg.runtime)
        )
        if self.primary:
            self.tokenizer = tokenizer_for_run(cfg, self.run_dir)
            self.store = prepare(cfg.data, self.tokenizer, cache_dir, progress=progress)
        barrier("jaxlab-data-prepared")
        if not self.primary:
            self.tokenizer = Tokenizer.load(self.run_dir.tokenizer_dir)
            self.store = prepare(cfg.data, self.tokenizer, cache_dir)
        self.loader = TrainLoader(
            self.store,
            cfg.data.seq_len,
            cfg.train.batch_size,
            cfg.runtime.seed,
            jax.process_index(),
            jax.process_count(),
        )
        self.schedule = learning_rate_schedule(t)
        self.tx = make_optimizer(t)
        # Sharding is a value: the mesh and the state's shardings decide the parallelism;
        # the step below is the same code for 1 device, N devices and N processes.
        self.mesh = build_mesh(cfg.parallel)
        check_model_fits(cfg.model, self.mesh)
        #: LoRA: the adapters' scale and dropout; the frozen base parameters (not state).
        self.lora = (
            None
            if t.lora is None
            else LoraSpec(lora_math.scale_of(t.lora.alpha, t.lora.rank), t.lora.dropout)
        )
        self.base_params: Any = None
        if self.lora is not None and t.lora is not None:
            assert self.base is not None and base_cfg is not None
            self.graphdef, _ = split_model(
                nnx.eval_shape(
                    lambda: make_model(cfg.model, t.precision, cfg.runtime.seed, remat=t.remat)
                )
            )
            shard = lambda p: param_shardings(p, self.mesh)  # noqa: E731
            self.base_params = cast_tree(
                base_run.load_params(self.base, base_cfg, shard), t.precision.param_dtype
            )
            params = lora_math.init_weights(
                cfg.model, t.lora.rank, t.lora.targets, jax.random.PRNGKey(cfg.runtime.seed)
            )
            master = False
        else:
            # The initial params are the master weights when those are on (init_state rounds).
            self.graphdef, params = initial_params(
                cfg.model, t.precision, cfg.runtime.seed, remat=t.remat
            )
            master = t.precision.master_dtype is not None
            if self.base is not None and base_cfg is not None:  # full fine-tuning, new run
                start = base_run.load_params(self.base, base_cfg)
                params = jax.tree.map(lambda b, p: b.astype(p.dtype), start, params)
        self.state_shardings = state_shardings(params, self.tx, self.mesh, master=master)
        param_dtype = t.precision.param_dtype if master else None
        self.state: TrainState = jax.jit(
            lambda p: init_state(p, self.tx, cfg.runtime.seed, param_dtype=param_dtype),
            out_shardings=self.state_shardings,
        )(params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        #: The step's arguments after (state, batch): the frozen base for LoRA.
        self.frozen: tuple[Any, ...] = () if self.lora is None else (self.base_params,)
        self.step_fn = ShapeKeyedJit(
            make_train_step(
                self.graphdef,
                self.tx,
                self.schedule,
                grad_accum_steps=t.grad_accum_steps,
                dropout=cfg.model.dropout_rate > 0,
                lora=self.lora,
                loss_chunk_tokens=t.loss_chunk_tokens,
            ),
            name="train_step",
            donate_argnums=(0,),
            out_shardings=(self.state_shardings, replicated),
        )
        self.eval_fn = ShapeKeyedJit(
            make_eval_step(self.graphdef, self.lora, loss_chunk_tokens=t.loss_chunk_tokens),
            name="eval_step",
            out_shardings=replicated,
        )
        self.restored: Restored[None] | None = None  # the last restore()'s step and skips
        self.checkpointer = Checkpointer(
            self.run_dir.checkpoint_dir,
            every_steps=cfg.checkpoint.every_steps,
            keep_last=cfg.checkpoint.keep_last,
            async_save=cfg.checkpoint.async_save,
        )
        trained = int(sum(x.size for x in jax.tree.leaves(params)))  # the adapter, with LoRA
        # Model FLOPs a step needs per token: a LoRA step computes no base weight gradients.
        self.flops_per_token = (
            flops_per_token(cfg.model, cfg.data.seq_len, training=True)
            if self.lora is None
            else lora_flops_per_token(cfg.model, cfg.data.seq_len, trained)
        )
        #: The MFU denominator (GFLOP/s, every device together) and what it is.
        self.peak_gflops: float | None = None
        self.mfu_basis: str | None = None
        if self.primary and (new_run or not self.run_dir.manifest_path.is_file()):
            extra: dict[str, Any] = {
                "tokenizer_sha256": self.tokenizer.sha256,
                "param_count": trained,
                "mesh": describe_mesh(self.mesh),
            }
            if self.base is not None:
                extra["base"] = self.base.to_json()
            if self.lora is not None:
                extra["trainable"] = "lora"
                extra["base_param_count"] = int(
                    sum(x.size for x in jax.tree.leaves(self.base_params))
                )
            self.run_dir.write_manifest(cfg, extra)

    # ------------------------------------------------------------------ state

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def restore(self, step: int | str | None = "latest") -> int:
        """Load a checkpoint into the trainer's state; returns its step.

        An explicit step is exactly that step; 'latest' is the newest intact one, and
        ``self.restored.note`` then names any damaged steps it skipped.
        """
        target = abstract_like(self.state)
        report = self.checkpointer.restore_intact(
            step, lambda s: self.checkpointer.restore(s, target)
        )
        restored, meta = report.value
        if meta.get("tokenizer_sha256") not in (None, self.tokenizer.sha256):
            raise ValueError("checkpoint tokenizer differs from the run's tokenizer")
        if self.lora is not None and self.base is not None:
            saved = (meta.get("base") or {}).get("params_sha256")
            if saved != self.base.params_sha256:
                raise base_run.WrongBase(
                    f"the adapter in {self.run_dir.path} (step {report.step})",
                    str(saved),
                    self.base.params_sha256,
                    f"restore the base it was trained on into {self.base.run_dir}",
                    given=f"the base this run records ({self.base.run_dir}, step {self.base.step})",
                )
        self.state = restored
        self.restored = Restored(report.step, None, report.skipped)
        return self.step

    def _set_aside_unreadable(self) -> None:
        """The restore skipped damaged newer steps: move them out of the way (bytes kept), or
        the saves of those step numbers that this run is about to make would be refused."""
        skipped = [k.step for k in self.restored.skipped] if self.restored is not None else []
        if not skipped:
            return
        if self.primary:
            moved = self.checkpointer.set_aside(skipped)
            if moved:
                where = ", ".join(str(p) for p in moved)
                self.observer.on_event(f"set aside damaged checkpoint(s): {where}")
        barrier("jaxlab-checkpoints-set-aside")
        self.checkpointer.reload()

    def _meta(self) -> dict[str, Any]:
        return {
            "config": run_identity(self.cfg),
            "tokenizer": tokenizer_files(self.run_dir.tokenizer_dir),
            "tokenizer_sha256": self.tokenizer.sha256,
            "step": self.step,
            **({"base": self.base.to_json()} if self.base is not None else {}),
        }

    def save(self, *, force: bool = False, wait: bool = False) -> bool:
        bad = int(self.state["bad_step"])  # a sync, but saves sync anyway
        if bad >= 0 and self.cfg.train.nonfinite_policy == "abort":
            return False
        started = self.checkpointer.save(self.step, self.state, self._meta(), force=force)
        if wait:
            self.checkpointer.wait()
        if started:
            self.observer.on_checkpoint(self.step)
        return started

    # ------------------------------------------------------------------ signals

    @contextmanager
    def _signals(self) -> Iterator[None]:
        def handler(signum: int, _frame: Any) -> None:
            if self._signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self._signal = signum

        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for s in previous:
                signal.signal(s, handler)
        except ValueError:  # not the main thread: no signal handling
            previous = {}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    # ------------------------------------------------------------------ loop

    def _device_batch(self, step: int) -> dict[str, jax.Array]:
        return place_batch(self.loader.batch(step), self.mesh)

    def _log(self, *records: dict[str, Any]) -> None:
        if self.primary:
            self.run_dir.append_metrics(*records)

    def _mfu_denominator(self) -> tuple[float, str]:
        """``(GFLOP/s, what it is)``: the devices' datasheet peak for the compute dtype where
        one is known (:mod:`jaxlab.runtime.datasheet`), else a quick matmul probe on this
        device (about half a second; below a CPU's best, so MFU reads high)."""
        dtype = str(self.cfg.train.precision.compute_dtype)
        sheet = datasheet_for(jax.devices()[0].device_kind)
        peak = None if sheet is None else sheet.matmul_gflops(dtype)
        if sheet is not None and peak is not None:
            n = jax.device_count()
            return peak * n, f"datasheet: {n} x {sheet.describe(dtype)}"
        return matmul_peak_gflops(dtype), f"measured: {dtype} matmul n=1024 at start-up"

    def run(
        self, stop_at: int | None = None, *, profile: tuple[int, int] | None = None
    ) -> TrainSummary:
        """Train until the step counter reaches ``stop_at`` (default ``train.steps``).

        ``profile=(START, STOP)``: a ``jax.profiler`` trace (``<run_dir>/profile/``, by the
        primary process) of the steps that take the counter from ``START`` to ``STOP``,
        with ``start <= START < STOP <= stop_at``; the device is waited for at both ends,
        so the trace holds exactly those steps' work.
        """
        cfg = self.cfg
        stop_at = stop_at or cfg.train.steps
        start = self.step
        if profile is not None and not start <= profile[0] < profile[1] <= stop_at:
            raise ValueError(
                f"profile steps {profile[0]}:{profile[1]} must lie within this run's steps "
                f"{start}:{stop_at}"
            )
        self._set_aside_unreadable()
        self.observer.on_start(self, start, stop_at)
        if self.peak_gflops is None:
            self.peak_gflops, self.mfu_basis = self._mfu_denominator()
            # Every step's "mfu" divides by this: say so once, beside them.
            self._log({"event": "mfu", "peak_gflops": self.peak_gflops, "basis": self.mfu_basis})

        batch = self._device_batch(start)
        self.step_fn.compile_for(self.state, batch, *self.frozen)
        ct = self.step_fn.timings[-1]
        self._log(
            {
                "event": "compile",
                "function": ct.name,
                "step": start,
                "trace_s": ct.trace_s,
                "lower_s": ct.lower_s,
                "compile_s": ct.compile_s,
                "total_s": ct.total_s,
            }
        )
        self.observer.on_event(f"compiled train_step in {ct.total_s:.2f}s")

        tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        last_loss: float | None = None
        rates: list[float] = []
        t_fetch = time.perf_counter()
        log_every = cfg.train.log_every_steps

        def flush() -> None:
            nonlocal t_fetch, last_loss
            if not pending:
                return
            host = jax.device_get([m for _, m in pending])
            now = time.perf_counter()
            step_s = (now - t_fetch) / len(pending)
            t_fetch = now
            tps = tokens_per_step / step_s
            mfu = (
                self.flops_per_token * tps / (self.peak_gflops * 1e9) if self.peak_gflops else None
            )
            records = []
            for (s, _), m in zip(pending, host, strict=True):
                rec = {
                    "event": "step",
                    "step": s,
                    "loss": float(m["loss"]),
                    "lr": float(m["lr"]),
                    "grad_norm": float(m["grad_norm"]),
                    "accuracy": float(m["accuracy"]),
                    "finite": bool(m["finite"]),
                    "step_time_s": step_s,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                }
                records.append(rec)
            # The first window includes the first execution; keep it out of the rate.
            if pending[0][0] > start + 1:
                rates.append(tps)
            pending.clear()
            self._log(*records)
            self.observer.on_metrics(records)
            finite = [r for r in records if r["finite"]]
            if finite:
                last_loss = finite[-1]["loss"]
            bad = [r for r in records if not r["finite"]]
            if bad and cfg.train.nonfinite_policy == "abort":
                good = self.checkpointer.latest_step()
                where = (
                    f"the last good checkpoint is step {good} (jaxlab resume --run-dir "
                    f"{self.run_dir.path} --step {good})"
                    if good is not None
                    else "no checkpoint was saved before it"
                )
                raise NonFiniteError(
                    f"non-finite loss or gradient norm at step {bad[0]['step']} "
                    f"(loss={bad[0]['loss']}, grad_norm={bad[0]['grad_norm']}); {where}; "
                    f"lower train.optimizer.learning_rate or set train.nonfinite_policy='skip'"
                )

        tracing = profile is not None and self.primary
        trace_dir = self.run_dir.path / "profile"
        trace_on = False

        with self._signals():
            try:
                step = start
                while step < stop_at:
                    if self._signal is not None:
                        flush()
                        self.save(force=True, wait=True)
                        raise Preempted(self._signal, self.step, self.run_dir.path)
                    if tracing and profile is not None and step == profile[0]:
                        jax.block_until_ready(self.state)
                        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
                        trace_on = True
                    self.state, metrics = self.step_fn(self.state, batch, *self.frozen)
                    step += 1
                    if trace_on and profile is not None and step == profile[1]:
                        jax.block_until_ready((self.state, metrics))
                        jax.profiler.stop_trace()
                        trace_on = False
                        self._log(
                            {"event": "profile", "steps": list(profile), "dir": str(trace_dir)}
                        )
                        self.observer.on_event(
                            f"profiled steps {profile[0]}:{profile[1]} into {trace_dir}"
                        )
                    pending.append((step, metrics))
                    self.observer.on_dispatch(step)
                    if step < stop_at:
                        batch = self._device_batch(step)  # overlaps with the device step
                    if step % log_every == 0 or step == stop_at:
                        flush()
                    if step % cfg.checkpoint.every_steps == 0 and step < stop_at:
                        flush()
                        self.save()
                flush()
                if self._signal is not None:
                    self.save(force=True, wait=True)
                    raise Preempted(self._signal, self.step, self.run_dir.path)
                self.save(force=True, wait=True)
            finally:
                if trace_on:
                    jax.profiler.stop_trace()
                self.checkpointer.wait()

        evaluation = self.evaluate()
        self._log({"event": "eval", "step": self.step, **evaluation})
        skipped = int(self.state["skipped"])
        tps = float(np.median(rates)) if rates else None
        return TrainSummary(
            run_dir=str(self.run_dir.path),
            steps=self.step,
            start_step=start,
            final_loss=last_loss,
            tokens_per_s=tps,
            mfu=(self.flops_per_token * tps / (self.peak_gflops * 1e9))
            if tps and self.peak_gflops
            else None,
            compile_s=ct.total_s,
            checkpoints=self.checkpointer.steps(),
            skipped_steps=skipped,
            eval=evaluation,
            extra={
                "peak_gflops": self.peak_gflops,
                "mfu_basis": self.mfu_basis,
                "recompiles": self.step_fn.compiles - 1,
            },
        )

    # ------------------------------------------------------------------ eval

    def evaluate(self, max_batches: int | None = None) -> dict[str, float]:
        """Token-weighted loss, perplexity and accuracy over the eval split."""
        return evaluate_params(
            self.eval_fn,
            self.state["params"],
            self.store,
            self.cfg.data.seq_len,
            self.cfg.train.batch_size,
            max_batches or self.cfg.train.eval_batches,
            mesh=self.mesh,
            frozen=self.frozen,
        )

    def evaluate_int8(
        self, max_batches: int | None = None, activations: Activations = "float"
    ) -> dict[str, float]:
        """The eval split scored by the int8 form of the parameters, beside the float ones
        (:mod:`jaxlab.train.quant_eval`): the int8 model's loss, perplexity and accuracy,
        and its greedy agreement with the float model; the same batches as
        :meth:`evaluate`."""
        from jaxlab.train.quant_eval import evaluate_int8, int8_weights, make_int8_eval_step

        if self.lora is not None:
            raise ValueError(
                f"{self.run_dir.path} is a LoRA run: merge it first (jaxlab merge --run-dir "
                f"{self.run_dir.path} --out DIR) and score the merged run's int8 weights"
            )
        params = self.state["params"]
        step = ShapeKeyedJit(
            make_int8_eval_step(self.graphdef),
            name="int8_eval_step",
            out_shardings=NamedSharding(self.mesh, PartitionSpec()),
        )
        return evaluate_int8(
            step,
            params,
            int8_weights(self.graphdef, params, activations),
            self.store,
            self.cfg.data.seq_len,
            self.cfg.train.batch_size,
            max_batches or self.cfg.train.eval_batches,
            mesh=self.mesh,
        )

    def close(self) -> None:
        """Wait for a save in flight and release the checkpointer; safe to call twice."""
        self.checkpointer.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def evaluate_params(
    eval_fn: ShapeKeyedJit,
    params: Any,
    store: Any,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    *,
    mesh: Any = None,
    frozen: tuple[Any, ...] = (),
) -> dict[str, float]:
    """``frozen``: ``eval_fn``'s arguments after the batch (a LoRA run's base)."""
    loss_sum = tokens = correct = 0.0
    batches = 0
    share = (jax.process_index(), jax.process_count())
    for b in eval_batches(
        store, seq_len, batch_size, max_batches, process_index=share[0], process_count=share[1]
    ):
        placed = (
            place_batch(b, mesh) if mesh is not None else {k: jnp.asarray(v) for k, v in b.items()}
        )
        out = jax.device_get(eval_fn(params, placed, *frozen))
        loss_sum += float(out["loss_sum"])
        tokens += float(out["tokens"])
        correct += float(out["correct"])
        batches += 1
    if tokens == 0:
        return {
            "loss": float("nan"),
            "perplexity": float("nan"),
            "accuracy": float("nan"),
            "tokens": 0.0,
            "batches": float(batches),
        }
    loss = loss_sum / tokens
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "accuracy": correct / tokens,
        "tokens": tokens,
        "batches": float(batches),
    }
