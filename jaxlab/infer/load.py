"""Restore a training run for inference: its parameters, config and tokenizer, nothing more.

The checkpoint is self-contained: its ``meta`` holds the resolved config (TOML) and the
tokenizer's files. Only the ``params`` subtree of the saved train state is read from disk
(Orbax partial restore), so no optimizer is built and no optimizer moments are loaded.
What is read is verified against the checkpoint's checksums; without an explicit step, a
damaged newest checkpoint is skipped for the newest intact one (``LoadedRun.note``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from jaxlab.config.schema import JaxlabConfig
from jaxlab.model import make_model, split_model
from jaxlab.runtime.logs import quiet_absl
from jaxlab.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxlab.checkpoint import Skipped


@dataclass(frozen=True)
class LoadedRun:
    """One checkpoint of a run, ready for an :class:`~jaxlab.infer.engine.Engine`.

    ``skipped`` lists the newer checkpoints passed over as unreadable (``note`` says so in
    one line)."""

    graphdef: nnx.GraphDef
    params: nnx.State
    cfg: JaxlabConfig
    tokenizer: Tokenizer
    step: int
    skipped: tuple[Skipped, ...] = ()

    @property
    def note(self) -> str | None:
        """``checkpoint step 60 is unreadable (...); using step 50``, or None."""
        from jaxlab.checkpoint import Restored

        return Restored(self.step, None, self.skipped).note


def load_run(
    run_dir: str | Path, step: int | None = None, *, cfg: JaxlabConfig | None = None
) -> LoadedRun:
    """Restore ``step`` (None = the newest intact checkpoint) of the run in ``run_dir``.

    ``cfg`` replaces the saved config (e.g. other ``inference.*`` or ``serve.*`` values);
    its model section must equal the checkpoint's. The params read are verified against
    the checkpoint's checksums. Raises ``FileNotFoundError`` for a directory without
    checkpoints, :class:`~jaxlab.checkpoint.CheckpointNotFound` for a missing step,
    :class:`~jaxlab.checkpoint.CheckpointUnreadable` for a damaged explicit ``step`` and
    :class:`~jaxlab.checkpoint.NoIntactCheckpoint` when every checkpoint is damaged.
    """
    from jaxlab.checkpoint import Checkpointer
    from jaxlab.config import from_toml
    from jaxlab.train.run_dir import RunDir

    rd = RunDir(run_dir)
    if not rd.checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no checkpoints/)")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def read(s: int) -> tuple[JaxlabConfig, Tokenizer, nnx.GraphDef, nnx.State]:
        meta = ck.restore_meta(s)
        saved_cfg = from_toml(meta["config"]) if "config" in meta else rd.load_config()
        if saved_cfg.train.lora is not None:
            raise ValueError(
                f"{run_dir} is a LoRA run: its checkpoints hold an adapter, not a model; "
                f"merge it (jaxlab merge --run-dir {run_dir} --out DIR) and use the merged run"
            )
        run_cfg = saved_cfg if cfg is None else cfg
        if run_cfg.model != saved_cfg.model:
            raise ValueError("cfg.model differs from the checkpoint's model config")
        tokenizer = _load_tokenizer(meta, rd.tokenizer_dir)
        model_cfg, precision = run_cfg.model, run_cfg.train.precision
        graphdef, abstract = split_model(
            nnx.eval_shape(lambda: make_model(model_cfg, precision, 0))
        )
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
        )
        params = ck.restore_subset(s, {"params": abstract})["params"]
        return run_cfg, tokenizer, graphdef, params

    with quiet_absl():  # a read-only manager warns that it ignores save options
        ck = Checkpointer(rd.checkpoint_dir, read_only=True)
    try:
        with quiet_absl():  # a read-only manager warns that it ignores save options
            restored = ck.restore_intact(step, read)
    finally:
        ck.close()
    run_cfg, tokenizer, graphdef, params = restored.value
    return LoadedRun(graphdef, params, run_cfg, tokenizer, restored.step, restored.skipped)


def _load_tokenizer(meta: dict[str, Any], fallback_dir: Path) -> Tokenizer:
    files = meta.get("tokenizer")
    if isinstance(files, dict) and files:
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in files.items():
                (Path(tmp) / Path(name).name).write_text(text)
            return Tokenizer.load(tmp)
    return Tokenizer.load(fallback_dir)


__all__ = ["LoadedRun", "load_run"]
