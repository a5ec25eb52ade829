"""``jaxlab train`` (also ``--from`` a base run), ``jaxlab resume``, ``jaxlab eval`` and
``jaxlab merge``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jaxlab.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    ConfigOpt,
    JsonOpt,
    SetOpt,
    UsageProblem,
    checkpoint_step,
    console,
    emit_json,
    resolve,
)

if TYPE_CHECKING:
    from jaxlab.checkpoint import Restored
    from jaxlab.train.trainer import Trainer

RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="The run directory.")]
StepsOpt = Annotated[
    int | None,
    typer.Option(
        "--steps",
        min=1,
        help="Stop after this many total steps (the LR schedule spans train.steps).",
    ),
]
StepOpt = Annotated[
    str,
    typer.Option("--step", callback=checkpoint_step, help="'latest' or a step number."),
]


def int8_choice(value: str) -> str:
    """``--weights`` / ``--activations``: ``float`` or ``int8``."""
    if value not in ("float", "int8"):
        raise typer.BadParameter(f"got {value!r}, expected 'float' or 'int8'")
    return value


WeightsOpt = Annotated[
    str,
    typer.Option(
        "--weights",
        callback=int8_choice,
        help=(
            "'int8': also score the eval split with the int8 weights inference would read"
            " (inference.weights), and report their perplexity and greedy agreement with"
            " the float weights."
        ),
    ),
]
ActivationsOpt = Annotated[
    str,
    typer.Option(
        "--activations",
        callback=int8_choice,
        help="With --weights int8: 'int8' quantizes each matmul's input too (inference.activations).",
    ),
]


def step_range(value: str | None) -> str | None:
    """``--profile START:STOP``: two step counts, ``0 <= START < STOP`` (checked by click,
    before anything loads; the run's own bounds are checked once they are known)."""
    if value is None:
        return None
    start, sep, stop = value.partition(":")
    if not (sep and start.isascii() and start.isdigit() and stop.isascii() and stop.isdigit()):
        raise typer.BadParameter(f"expected START:STOP, two step numbers (got {value!r})")
    if int(start) >= int(stop):
        raise typer.BadParameter(f"START must be below STOP (got {value!r})")
    return value


ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        callback=step_range,
        metavar="START:STOP",
        help="Write a jax.profiler trace of the steps that take the step counter from START "
        "to STOP (as --steps counts) into RUN_DIR/profile/; open it in TensorBoard or "
        "ui.perfetto.dev (docs/benchmarking.md#profiling).",
    ),
]


def _profile_steps(spec: str | None, start: int, stop_at: int) -> tuple[int, int] | None:
    """``--profile``'s steps, checked against the run's: ``start <= START < STOP <= stop_at``."""
    if spec is None:
        return None
    a, b = (int(x) for x in spec.split(":"))
    if a < start or b > stop_at:
        raise UsageProblem(
            f"--profile {spec}: the steps must lie within this run's, {start}:{stop_at}"
        )
    return a, b


class TrainView:
    """Rich live view on a TTY; plain lines (one per log interval) otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.live = console.is_terminal and not quiet
        self.last_ckpt: int | None = None
        self.latest: dict[str, Any] = {}
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> TrainView:
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=console,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)

    def _status(self) -> str:
        m = self.latest
        if not m:
            return "compiling"
        mfu = f" mfu {m['mfu']:.1%}" if m.get("mfu") is not None else ""
        ck = f" ckpt {self.last_ckpt}" if self.last_ckpt is not None else ""
        return f"loss {m['loss']:.4f}  {m['tokens_per_s']:,.0f} tok/s{mfu}{ck}"

    # TrainObserver hooks
    def on_start(self, trainer: Trainer, start_step: int, stop_at: int) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(
                "train", total=stop_at, completed=start_step, status="compiling"
            )
        elif not self.quiet:
            console.print(f"training steps {start_step}..{stop_at} in {trainer.run_dir.path}")

    def on_dispatch(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def on_metrics(self, records: list[dict[str, Any]]) -> None:
        self.latest = records[-1]
        if self._progress is not None:
            self._progress.update(self._task, status=self._status())
        elif not self.quiet:
            console.print(f"step {self.latest['step']}: {self._status()}", markup=False)

    def on_checkpoint(self, step: int) -> None:
        self.last_ckpt = step
        if self._progress is None and not self.quiet:
            console.print(f"checkpoint saved at step {step}")

    def on_event(self, message: str) -> None:
        if not self.quiet:
            console.print(message, markup=False)


def _quiet_libraries() -> None:
    """Orbax and absl log every save at INFO; keep that for --log-level DEBUG."""
    import logging

    from jaxlab.cli.common import STATE

    if STATE.log_level != "DEBUG":
        logging.getLogger("absl").setLevel(logging.WARNING)


def _run(trainer: Trainer, stop_at: int | None, json_: bool, profile: str | None = None) -> None:
    from jaxlab.train.trainer import NonFiniteError, Preempted

    try:
        steps = _profile_steps(profile, trainer.step, stop_at or trainer.cfg.train.steps)
    except UsageProblem:
        trainer.close()
        raise
    # In a multi-process run only process 0 talks; the others train silently.
    primary = trainer.primary
    view = TrainView(quiet=not primary)
    trainer.observer = view
    t0 = time.perf_counter()
    try:
        with view:
            summary = trainer.run(stop_at, profile=steps)
    except Preempted as p:
        if primary:
            console.print(str(p), markup=False)
        if json_ and primary:
            emit_json(
                {"run_dir": str(p.run_dir), "preempted": True, "step": p.step, "signal": p.signum}
            )
        import signal

        raise typer.Exit(
            EXIT_TERMINATED if p.signum == signal.SIGTERM else EXIT_INTERRUPTED
        ) from None
    except NonFiniteError as e:
        if primary:
            console.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        raise typer.Exit(EXIT_FAILURE) from None
    finally:
        trainer.close()
    doc = summary.to_json()
    if trainer.restored is not None:
        doc["skipped_checkpoints"] = _skipped(trainer.restored)
    doc["wall_s"] = time.perf_counter() - t0
    if not primary:
        return
    if json_:
        emit_json(doc)
    else:
        ev = summary.eval or {}
        console.print(
            f"done: {summary.steps} steps, final loss {summary.final_loss:.4f}, "
            f"eval loss {ev.get('loss', float('nan')):.4f} (ppl {ev.get('perplexity', float('nan')):.2f}), "
            f"{(summary.tokens_per_s or 0):,.0f} tok/s, compile {summary.compile_s:.2f}s, "
            f"checkpoints {summary.checkpoints}; run dir {summary.run_dir}",
            markup=False,
            soft_wrap=True,
        )


def _skipped(restored: Restored[None]) -> list[dict[str, Any]]:
    return [{"step": s.step, "reason": s.reason} for s in restored.skipped]


def _restore(trainer: Trainer, step: str) -> int:
    """Restore ``step`` into ``trainer`` and say which damaged steps it skipped, if any.

    On any failure the trainer is closed before the error propagates: an open one would
    leave Orbax's threads running into interpreter shutdown."""
    from jaxlab.checkpoint import CheckpointNotFound
    from jaxlab.train.base import BaseRunError

    try:
        restored = trainer.restore(step)
    except (CheckpointNotFound, BaseRunError) as e:
        trainer.close()
        raise UsageProblem(str(e)) from None
    except BaseException:
        trainer.close()
        raise
    note = trainer.restored.note if trainer.restored is not None else None
    if note is not None and trainer.primary:
        console.print(note, markup=False, soft_wrap=True)
    return restored


def _configure(cfg: Any) -> None:
    """Platform, compilation cache and multi-process runtime first: all must precede any jax
    computation."""
    from jaxlab.parallel.distributed import initialize
    from jaxlab.runtime import configure_runtime

    configure_runtime(cfg.runtime)
    _quiet_libraries()
    initialize(cfg.runtime)


def _trainer(cfg: Any, run_dir: Path) -> Trainer:
    """A :class:`Trainer`; a base that cannot be used (missing, or not the one this run was
    started from) is a usage error."""
    from jaxlab.train.base import BaseRunError
    from jaxlab.train.trainer import Trainer

    try:
        return Trainer(cfg, run_dir)
    except BaseRunError as e:
        raise UsageProblem(str(e)) from None


def _from_base(cfg: Any, base_dir: Path) -> Any:
    """``cfg`` adopting the base run's model and tokenizer (``train --from``); a bad base is
    a usage error."""
    from jaxlab.train import base as base_run

    try:
        ref, base_cfg = base_run.resolve(base_dir)
    except base_run.BaseRunError as e:
        raise UsageProblem(str(e)) from None
    return base_run.adopt(cfg, base_cfg, ref)


def register(app: typer.Typer) -> None:
    @app.command(
        epilog="Examples: jaxlab train --config tiny --steps 50 --run-dir artifacts/runs/demo\n\n"
        "jaxlab train --from artifacts/runs/demo --set data.source=... "
        "--set train.lora.rank=8 --run-dir artifacts/runs/demo-lora"
    )
    def train(
        config: ConfigOpt = "tiny",
        set_: SetOpt = None,
        from_: Annotated[
            Path | None,
            typer.Option(
                "--from",
                help="Start from this run's newest checkpoint: its parameters, model and "
                "tokenizer, a fresh optimizer and step 0 (full fine-tuning; with train.lora.* "
                "set, LoRA adapters on the frozen base). The run records the base's path and "
                "params hash.",
            ),
        ] = None,
        steps: StepsOpt = None,
        run_dir: Annotated[
            Path | None, typer.Option("--run-dir", help="Default artifacts/runs/<run_id>.")
        ] = None,
        processes: Annotated[
            int, typer.Option("--processes", min=1, help="Local processes (jax.distributed).")
        ] = 1,
        profile: ProfileOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Train a model from a config; checkpoints, metrics and manifest go to the run dir."""
        sets = list(set_ or [])
        if from_ is not None:
            sets.append(f"train.init_from={str(from_.absolute())!r}")
        cfg = resolve(config, sets).config
        if cfg.train.init_from is not None:
            cfg = _from_base(cfg, Path(cfg.train.init_from))
        if profile is not None:  # the run's bounds are known now: fail before any work
            _profile_steps(profile, 0, steps or cfg.train.steps)
        if processes > 1:
            from jaxlab.parallel.launch import launch
            from jaxlab.train import new_run_id

            # Every process must agree on the run directory, so fix it before forking.
            path = run_dir or Path(cfg.runtime.artifacts_dir) / "runs" / new_run_id()
            args = ["train", "--run-dir", str(path)]
            args += ["--config", config] if config else []
            args += [x for s in (set_ or []) for x in ("--set", s)]
            args += ["--from", str(from_)] if from_ is not None else []
            args += ["--steps", str(steps)] if steps else []
            args += ["--profile", profile] if profile else []
            args += ["--json"] if json_ else []
            raise typer.Exit(launch(args, processes))
        _configure(cfg)
        from jaxlab.train import new_run_id
        from jaxlab.train.run_dir import RunDir

        path = run_dir or Path(cfg.runtime.artifacts_dir) / "runs" / new_run_id()
        if RunDir(path).exists():
            raise UsageProblem(
                f"--run-dir {path} already holds a run; use 'jaxlab resume --run-dir {path}' "
                "or a new directory"
            )
        trainer = _trainer(cfg, path)
        _run(trainer, steps, json_, profile)

    @app.command(epilog="Example: jaxlab resume --run-dir artifacts/runs/demo --steps 100")
    def resume(
        run_dir: RunDirOpt,
        step: StepOpt = "latest",
        steps: StepsOpt = None,
        profile: ProfileOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Continue a run exactly from a checkpoint (bitwise on CPU)."""
        from jaxlab.train.run_dir import PER_PROCESS_FIELDS, RunDir

        rd = RunDir(run_dir)
        if not rd.exists():
            raise UsageProblem(f"--run-dir {run_dir}: not a run directory (no config.toml)")
        cfg = rd.load_config(env_may_change=PER_PROCESS_FIELDS)
        _configure(cfg)
        trainer = _trainer(cfg, run_dir)
        restored = _restore(trainer, step)
        console.print(f"resumed from step {restored}", markup=False)
        _run(trainer, steps, json_, profile)

    @app.command("eval", epilog="Example: jaxlab eval --run-dir artifacts/runs/demo --json")
    def eval_(
        run_dir: RunDirOpt,
        step: StepOpt = "latest",
        batches: Annotated[
            int | None,
            typer.Option("--batches", min=1, help="Eval batches (default train.eval_batches)."),
        ] = None,
        weights: WeightsOpt = "float",
        activations: ActivationsOpt = "float",
        json_: JsonOpt = False,
    ) -> None:
        """Token-weighted loss, perplexity and accuracy over the eval split (padding excluded).

        With --weights int8, the same for the int8 weights inference would read, and their
        greedy agreement with the float weights (docs/quantization.md)."""
        from jaxlab.train.run_dir import PER_PROCESS_FIELDS, RunDir

        if activations == "int8" and weights != "int8":
            raise UsageProblem(
                "--activations int8 quantizes the input of int8 weights; add --weights int8"
            )
        rd = RunDir(run_dir)
        if not rd.exists():
            raise UsageProblem(f"--run-dir {run_dir}: not a run directory (no config.toml)")
        cfg = rd.load_config(env_may_change=PER_PROCESS_FIELDS)
        _configure(cfg)
        trainer = _trainer(cfg, run_dir)
        restored = _restore(trainer, step)
        with trainer:
            result: dict[str, Any] = {
                "run_dir": str(run_dir),
                "step": restored,
                **trainer.evaluate(batches),
            }
            if weights == "int8":
                int8 = trainer.evaluate_int8(batches, "int8" if activations == "int8" else "float")
                result["int8"] = {"activations": activations, **int8}
                result["int8"]["perplexity_ratio"] = int8["perplexity"] / result["perplexity"]
        assert trainer.restored is not None
        result["skipped_checkpoints"] = _skipped(trainer.restored)
        if json_:
            emit_json(result)
            return
        console.print(
            f"step {restored}: loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}, "
            f"accuracy {result['accuracy']:.3f} over {int(result['tokens'])} tokens",
            markup=False,
        )
        if weights == "int8":
            q = result["int8"]
            console.print(
                f"int8 weights ({activations} activations): loss {q['loss']:.4f}, perplexity"
                f" {q['perplexity']:.2f} ({100 * (q['perplexity_ratio'] - 1):+.2f}% of float),"
                f" accuracy {q['accuracy']:.3f}, greedy agreement with float"
                f" {q['greedy_agreement']:.4f}",
                markup=False,
            )

    @app.command(
        epilog="Example: jaxlab merge --run-dir artifacts/runs/demo-lora --out "
        "artifacts/runs/demo-merged"
    )
    def merge(
        run_dir: Annotated[Path, typer.Option("--run-dir", help="The LoRA run.")],
        out: Annotated[Path, typer.Option("--out", help="The merged run's new directory.")],
        step: StepOpt = "latest",
        json_: JsonOpt = False,
    ) -> None:
        """Fold a LoRA run's adapter into its base (W + A B alpha/rank) and write a full run
        directory that generate, eval, serve and resume read like any other."""
        from jaxlab.train.adapter import lora_config
        from jaxlab.train.base import BaseRunError

        try:
            cfg = lora_config(run_dir)
        except BaseRunError as e:
            raise UsageProblem(f"--run-dir {e}") from None
        _configure(cfg)
        from jaxlab.checkpoint import CheckpointNotFound
        from jaxlab.train.adapter import merge_run

        try:
            summary = merge_run(run_dir, out, None if step == "latest" else int(step))
        except (BaseRunError, CheckpointNotFound) as e:
            raise UsageProblem(str(e)) from None
        if json_:
            emit_json(summary)
            return
        console.print(
            f"merged {run_dir} (step {summary['step']}) into its base: {summary['run_dir']}",
            markup=False,
            soft_wrap=True,
        )
