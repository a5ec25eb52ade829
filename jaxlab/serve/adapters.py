"""The LoRA adapters one server serves on its base model: named, checked, stacked.

``serve.adapters`` (``jaxlab serve --adapter NAME=LORA_RUN``) names LoRA run directories.
This module turns ``NAME=PATH`` options into that mapping, checks every adapter against the
served base checkpoint (its recorded base params hash must be the base's: an adapter
trained on another base would serve garbage), and reads and stacks them for the engine
(:func:`jaxlab.model.lora.stack`: adapter ``i`` of the mapping gets id ``i + 1``, id 0 is
the base model). It decides nothing about requests: the app maps a request's ``model``
to an id (:meth:`~jaxlab.serve.service.ModelService.adapter_id`).

:func:`check_adapters` reads metadata only (the CLI runs it before loading anything, so a
bad adapter is a usage error, exit 2); :func:`load_adapters` reads the weights and checks
the hash again, against the checkpoint actually loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class AdapterProblem(ValueError):
    """An adapter that cannot be served on this base (the message names it and the fix)."""


def parse_adapter_options(options: Sequence[str]) -> dict[str, str]:
    """``["NAME=PATH", ...]`` (``--adapter``, repeatable) as ``{name: path}``;
    :class:`AdapterProblem` for a malformed or repeated one."""
    from jaxlab.config.schema import ADAPTER_NAME

    out: dict[str, str] = {}
    for text in options:
        name, sep, path = text.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise AdapterProblem(
                f"--adapter {text!r}: expected NAME=LORA_RUN_DIR (e.g. --adapter "
                "support=runs/support-lora)"
            )
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterProblem(
                f"--adapter {text!r}: the name {name!r} may hold letters, digits, '.', '_', ':'"
                " and '-' only (it is the 'model' a request names)"
            )
        if name in out:
            raise AdapterProblem(f"--adapter {name}: given twice; give each adapter one name")
        out[name] = path
    return out


def base_params_sha256(run_dir: str | Path, step: int | None) -> tuple[int, str]:
    """``(step, params sha256)`` of the base checkpoint ``step`` (None: the newest) of
    ``run_dir``: what an adapter's recorded base must equal. Reads metadata only."""
    from jaxlab.checkpoint import Checkpointer
    from jaxlab.runtime.logs import quiet_absl
    from jaxlab.train.base import params_digest

    with quiet_absl():  # a read-only manager warns that it ignores save options
        ck = Checkpointer(Path(run_dir) / "checkpoints", read_only=True)
    try:
        s = ck.resolve_step(step)
        digest = params_digest(ck.restore_meta(s))
    finally:
        ck.close()
    if digest is None:
        raise AdapterProblem(
            f"--run-dir {run_dir}: checkpoint step {s} records no checksums, so no adapter can "
            "be checked against it; resume the run for one step to save one that does"
        )
    return s, digest


def check_adapters(
    adapters: Mapping[str, str], base_run_dir: str | Path, base_step: int | None
) -> None:
    """Every adapter is a LoRA run trained on this base checkpoint, or
    :class:`AdapterProblem` naming the adapter, both hashes and the fix."""
    from jaxlab.train.adapter import lora_config
    from jaxlab.train.base import BaseRunError, read_record

    if not adapters:
        return
    step, digest = base_params_sha256(base_run_dir, base_step)
    for name, path in adapters.items():
        try:
            lora_config(path)
            recorded = read_record(Path(path))
        except BaseRunError as e:
            raise AdapterProblem(f"--adapter {name}={path}: {e}") from None
        if recorded.params_sha256 != digest:
            raise AdapterProblem(
                f"--adapter {name}={path}: the adapter belongs to the base with params sha256 "
                f"{recorded.params_sha256} ({recorded.run_dir}, step {recorded.step}), but "
                f"--run-dir {base_run_dir} (step {step}) has params sha256 {digest}; serve it "
                "on its own base, or train the adapter on this one"
            )


def load_adapters(
    adapters: Mapping[str, str], params_sha256: str, model_cfg: Any
) -> tuple[tuple[str, ...], tuple[Any, Any]]:
    """The adapters' names (in id order: name ``i`` is id ``i + 1``) and their stacked
    ``(weights, scale)`` for the engine; each adapter is checked against the base's
    ``params_sha256`` (:class:`~jaxlab.train.base.WrongBase` otherwise)."""
    from jaxlab.model import lora
    from jaxlab.train.adapter import check_base, load_adapter

    loaded = []
    for name, path in adapters.items():
        a = load_adapter(path)
        check_base(a, params_sha256, f"the served base (adapter {name!r})")
        loaded.append((a.weights, a.scale))
    return tuple(adapters), lora.stack(model_cfg, loaded)


__all__ = [
    "AdapterProblem",
    "base_params_sha256",
    "check_adapters",
    "load_adapters",
    "parse_adapter_options",
]
