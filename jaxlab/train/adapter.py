"""A LoRA run's adapter outside its training loop: loading it, checking its base, merging it.

A LoRA run's checkpoint holds the adapter (``state/params``: :data:`jaxlab.model.lora.Weights`,
one adapter), its optimizer state and step, and in ``meta["base"]`` the :class:`BaseRef` of
the base it was trained on. :func:`load_adapter` reads the adapter alone (no optimizer
state) and :func:`check_base` refuses a base whose params hash is not the recorded one;
:func:`merge_run` folds the adapter into its base and writes a plain run directory that
``generate``, ``eval``, ``serve`` and ``resume`` read like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxlab.train.base import BaseRef, BaseRunError, WrongBase


class NotALoraRun(BaseRunError):
    """The run directory given holds no LoRA run."""


@dataclass(frozen=True)
class Adapter:
    """One checkpoint of a LoRA run: ``weights`` (``N = 1``, layer axis leading), ``scale``
    (``alpha / rank``), its step, its base, and the run's config."""

    weights: Any
    scale: float
    step: int
    base: BaseRef
    cfg: Any
    run_dir: str

    @property
    def rank(self) -> int:
        return int(self.cfg.train.lora.rank)


def lora_config(run_dir: str | Path) -> Any:
    """A LoRA run's config; :class:`NotALoraRun` for any other directory."""
    from jaxlab.train.run_dir import RunDir

    rd = RunDir(run_dir)
    if not rd.exists():
        raise NotALoraRun(f"{run_dir}: not a run directory (no config.toml)")
    cfg = rd.load_config(env_may_change=())
    if cfg.train.lora is None:
        raise NotALoraRun(
            f"{run_dir}: not a LoRA run (its config has no train.lora); it is a full run, "
            "which generate, eval and serve read directly"
        )
    return cfg


def load_adapter(run_dir: str | Path, step: int | None = None) -> Adapter:
    """The adapter of a LoRA run's checkpoint ``step`` (None: the newest intact one), read
    alone (partial restore, verified against its checksums) onto one device."""
    import jax

    from jaxlab.checkpoint import Checkpointer
    from jaxlab.model import lora as lora_math
    from jaxlab.runtime.logs import quiet_absl
    from jaxlab.train.run_dir import RunDir

    cfg = lora_config(run_dir)
    t = cfg.train
    assert t.lora is not None
    rd = RunDir(run_dir)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(
        lambda: lora_math.init_weights(cfg.model, t.lora.rank, t.lora.targets, jax.random.key(0))
    )
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
    )

    def read(s: int) -> tuple[Any, dict[str, Any]]:
        meta = ck.restore_meta(s)
        return ck.restore_subset(s, {"params": target})["params"], meta

    with quiet_absl():
        ck = Checkpointer(rd.checkpoint_dir, read_only=True)
    try:
        with quiet_absl():
            restored = ck.restore_intact(step, read)
    finally:
        ck.close()
    weights, meta = restored.value
    if "base" not in meta:
        raise BaseRunError(f"{run_dir}: checkpoint step {restored.step} records no base")
    return Adapter(
        weights,
        lora_math.scale_of(t.lora.alpha, t.lora.rank),
        restored.step,
        BaseRef.from_json(meta["base"]),
        cfg,
        str(Path(run_dir).absolute()),
    )


def check_base(adapter: Adapter, params_sha256: str, where: str = "the base given") -> None:
    """Raise :class:`WrongBase` (naming both hashes) unless ``params_sha256`` is the hash of
    the base ``adapter`` was trained on."""
    if params_sha256 != adapter.base.params_sha256:
        raise WrongBase(
            f"the adapter of {adapter.run_dir} (step {adapter.step})",
            adapter.base.params_sha256,
            params_sha256,
            f"load it on its own base ({adapter.base.run_dir}, step {adapter.base.step})",
            given=where,
        )


def merge_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> dict[str, Any]:
    """Fold the adapter of LoRA run ``run_dir`` into its base and write the result as a new
    run directory ``out``: the LoRA run's config without ``train.lora`` and
    ``train.init_from``, its tokenizer, and one checkpoint at the adapter's step (merged
    params, a fresh optimizer state). Returns a summary."""
    import jax
    from flax import nnx

    from jaxlab.checkpoint import Checkpointer
    from jaxlab.model import lora as lora_math
    from jaxlab.train import base as base_run
    from jaxlab.train.optimizer import make_optimizer
    from jaxlab.train.run_dir import RunDir, run_identity
    from jaxlab.train.step import cast_tree, init_state
    from jaxlab.train.trainer import tokenizer_files

    dest = RunDir(out)
    if dest.exists() or (dest.path.exists() and any(dest.path.iterdir())):
        raise BaseRunError(f"--out {out} already exists and is not empty; choose a new directory")
    adapter = load_adapter(run_dir, step)
    ref, base_cfg = base_run.resolve(adapter.base.run_dir, adapter.base.step)
    check_base(adapter, ref.params_sha256, f"{ref.run_dir} step {ref.step} as it is now")
    params = base_run.load_params(ref, base_cfg)
    cfg = adapter.cfg.model_copy(deep=True)
    cfg.train.lora = None
    cfg.train.init_from = None
    pure = lora_math.merge(cfg.model, nnx.to_pure_dict(params), adapter.weights, adapter.scale)
    nnx.replace_by_pure_dict(params, pure)
    precision = cfg.train.precision
    params = cast_tree(params, precision.param_dtype)
    master = precision.master_dtype
    state = init_state(
        params if master is None else cast_tree(params, master),
        make_optimizer(cfg.train),
        cfg.runtime.seed,
        param_dtype=None if master is None else precision.param_dtype,
    )
    state["step"] = jax.numpy.asarray(adapter.step, jax.numpy.int32)

    dest.create(cfg)
    src_tok = RunDir(run_dir).tokenizer_dir
    dest.tokenizer_dir.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files(src_tok).items():
        (dest.tokenizer_dir / name).write_text(text)
    from jaxlab.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(dest.tokenizer_dir)
    merged_from = {
        "lora_run": adapter.run_dir,
        "lora_step": adapter.step,
        "base": adapter.base.to_json(),
        "rank": adapter.rank,
        "scale": adapter.scale,
        "merged": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    dest.write_manifest(
        cfg,
        {
            "tokenizer_sha256": tokenizer.sha256,
            "param_count": int(sum(x.size for x in jax.tree.leaves(params))),
            "merged_from": merged_from,
        },
    )
    meta = {
        "config": run_identity(cfg),
        "tokenizer": tokenizer_files(dest.tokenizer_dir),
        "tokenizer_sha256": tokenizer.sha256,
        "step": adapter.step,
        "merged_from": merged_from,
    }
    with Checkpointer(dest.checkpoint_dir, async_save=False) as ck:
        ck.save(adapter.step, state, meta, force=True)
        ck.wait()
    return {"run_dir": str(dest.path), "step": adapter.step, "merged_from": merged_from}


__all__ = [
    "Adapter",
    "NotALoraRun",
    "check_base",
    "load_adapter",
    "lora_config",
    "merge_run",
]
