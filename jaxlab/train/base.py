"""A run started from another run (``train.init_from``, ``jaxlab train --from``): its base.

This module owns finding a base run's checkpoint, the hash that names its parameters, reading
those parameters, the config sections a run started from it adopts (model, tokenizer), and
the record (``<run_dir>/base.json``) of which base a run came from. It does not decide what
trains: full fine-tuning trains the base's parameters, LoRA adapters on top of them
(:mod:`jaxlab.train.trainer`).

The hash (:func:`params_digest`) is a sha256 of the base checkpoint's recorded ``params``
checksums (:mod:`jaxlab.checkpoint.checksum`): it names the parameters' exact values without
reading them, and reading them verifies the same checksums, so parameters that load under a
hash are the ones it names.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jaxlab.runtime.logs import quiet_absl

#: Where a run records its base (beside ``config.toml``).
BASE_FILE = "base.json"


class BaseRunError(ValueError):
    """The base run cannot be used: not a run directory, no checkpoint, no checksums."""


class WrongBase(BaseRunError):
    """Parameters (or an adapter) were asked to sit on a base other than their own."""

    def __init__(self, what: str, expected: str, found: str, fix: str, given: str):
        self.expected = expected
        self.found = found
        super().__init__(
            f"{what} was trained on the base with params sha256 {expected}, but {given} has "
            f"params sha256 {found}; {fix}"
        )


@dataclass(frozen=True)
class BaseRef:
    """One checkpoint of a base run: its directory (absolute), step and params hash."""

    run_dir: str
    step: int
    params_sha256: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BaseRef:
        return cls(str(data["run_dir"]), int(data["step"]), str(data["params_sha256"]))


def params_digest(meta: dict[str, Any]) -> str | None:
    """sha256 of a checkpoint's recorded ``params/...`` checksums (path, shape, dtype, sum);
    None for a checkpoint saved before checksums existed."""
    arrays = (meta.get("checksums") or {}).get("arrays")
    if not isinstance(arrays, dict):
        return None
    params = {p: v for p, v in sorted(arrays.items()) if p.startswith("params/")}
    if not params:
        return None
    text = json.dumps(params, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _checkpointer(run_dir: Path) -> Any:
    from jaxlab.train.run_dir import RunDir

    rd = RunDir(run_dir)
    if not rd.exists():
        raise BaseRunError(f"--from {run_dir}: not a run directory (no config.toml)")
    if not rd.checkpoint_dir.is_dir():
        raise BaseRunError(f"--from {run_dir}: the run has no checkpoints/ to start from")
    from jaxlab.checkpoint import Checkpointer  # after the cheap checks: it imports jax

    with quiet_absl():  # a read-only manager warns that it ignores save options
        return Checkpointer(rd.checkpoint_dir, read_only=True)


def resolve(run_dir: str | Path, step: int | None = None) -> tuple[BaseRef, Any]:
    """The base run's checkpoint ``step`` (None: the newest) as a :class:`BaseRef`, with the
    config that checkpoint was saved with. Reads metadata only."""
    from jaxlab.checkpoint import CheckpointNotFound, CheckpointUnreadable
    from jaxlab.config import from_toml

    path = Path(run_dir).absolute()
    ck = _checkpointer(path)
    try:
        s = ck.resolve_step(step)
        meta = ck.restore_meta(s)
    except (CheckpointNotFound, CheckpointUnreadable) as e:
        raise BaseRunError(f"--from {run_dir}: {e}") from None
    finally:
        ck.close()
    digest = params_digest(meta)
    if digest is None:
        raise BaseRunError(
            f"--from {run_dir}: checkpoint step {s} records no checksums, so its parameters "
            "cannot be named by a hash; resume that run for one step with this jaxlab to save "
            "a checkpoint that does"
        )
    if "config" not in meta:
        raise BaseRunError(f"--from {run_dir}: checkpoint step {s} holds no config")
    return BaseRef(str(path), s, digest), from_toml(meta["config"])


def load_params(ref: BaseRef, base_cfg: Any, sharding: Callable[[Any], Any] | None = None) -> Any:
    """The base's parameters (``nnx.State``, in the dtypes they were saved in), verified
    against the checkpoint's checksums, and its hash checked against ``ref``'s (a base run
    whose checkpoint changed since ``ref`` was taken raises :class:`WrongBase`).

    ``sharding(abstract_params)``: the shardings to read them onto (default: one device).
    """
    import jax
    from flax import nnx

    from jaxlab.model import make_model, split_model

    _, abstract = split_model(
        nnx.eval_shape(lambda: make_model(base_cfg.model, base_cfg.train.precision, 0))
    )
    if sharding is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = sharding(abstract)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    ck = _checkpointer(Path(ref.run_dir))
    try:
        digest = params_digest(ck.restore_meta(ref.step))
        if digest != ref.params_sha256:
            raise WrongBase(
                "this run",
                ref.params_sha256,
                str(digest),
                "the base run's checkpoint changed since this run was started from it; restore "
                "that checkpoint, or start a new run from the base as it is now",
                given=f"its base's checkpoint now ({ref.run_dir}, step {ref.step})",
            )
        with quiet_absl():  # a read-only manager warns that it ignores save options
            return ck.restore_subset(ref.step, {"params": target})["params"]
    finally:
        ck.close()


def adopt(cfg: Any, base_cfg: Any, ref: BaseRef) -> Any:
    """``cfg`` as a run started from the base: the base's model and tokenizer sections (the
    parameters and vocabulary are the base's), ``train.init_from`` its absolute path."""
    data = cfg.model_dump()
    data["model"] = base_cfg.model.model_dump()
    data["tokenizer"] = base_cfg.tokenizer.model_dump()
    data["train"]["init_from"] = ref.run_dir
    return type(cfg).model_validate(data)


def copy_tokenizer(ref: BaseRef, run_dir: Path) -> None:
    """The base's tokenizer files into ``run_dir/tokenizer`` (the base's vocabulary)."""
    src = Path(ref.run_dir) / "tokenizer"
    dest = run_dir / "tokenizer"
    if not (src / "tokenizer.json").is_file():
        raise BaseRunError(f"--from {ref.run_dir}: the run has no tokenizer/ to start from")
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file():
            shutil.copy2(p, dest / p.name)


def write_record(run_dir: Path, ref: BaseRef) -> None:
    (run_dir / BASE_FILE).write_text(json.dumps(ref.to_json(), indent=2) + "\n")


def read_record(run_dir: Path) -> BaseRef:
    path = run_dir / BASE_FILE
    try:
        return BaseRef.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise BaseRunError(
            f"{run_dir} was started from a base (train.init_from) but has no {BASE_FILE}"
        ) from None


__all__ = [
    "BASE_FILE",
    "BaseRef",
    "BaseRunError",
    "WrongBase",
    "adopt",
    "copy_tokenizer",
    "load_params",
    "params_digest",
    "read_record",
    "resolve",
    "write_record",
]
