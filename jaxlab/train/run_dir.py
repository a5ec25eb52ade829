"""The run directory: everything a run leaves behind, append-only where it grows.

<run_dir>/config.toml      resolved config (rewritten only if identical or new)
<run_dir>/manifest.json    versions, devices, XLA flags, JAXLAB_* env, git, command line
<run_dir>/metrics.jsonl    one JSON object per logged step or event, appended and flushed
<run_dir>/tokenizer/       the tokenizer files (rank file + metadata, with its sha256)
<run_dir>/checkpoints/     Orbax step directories
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxlab.config import JaxlabConfig, config_hash, to_toml

#: Per-process launch state: not part of a run's identity (each process of a multi-process
#: run takes it from its own environment), so a ``JAXLAB_*`` variable may set it.
PER_PROCESS_FIELDS = ("runtime.distributed",)


def run_identity(cfg: JaxlabConfig) -> str:
    """The config as the run directory stores it: everything except per-process launch
    state (``PER_PROCESS_FIELDS``), which each process takes from its own environment."""
    from jaxlab.config.schema import DistributedConfig

    stored = cfg.model_copy(deep=True)
    stored.runtime.distributed = DistributedConfig()
    return to_toml(stored)


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _show(value: Any) -> str:
    return "(unset)" if value is None else repr(value)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    def exists(self) -> bool:
        return self.config_path.is_file()

    def create(self, cfg: JaxlabConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.config_path, run_identity(cfg))

    def holds(self, cfg: JaxlabConfig) -> bool:
        """Whether this run's stored config is ``cfg``'s identity (:func:`run_identity`),
        compared as configs rather than as text: a field added to jaxlab since the run was
        made reads as its default, and a value an older jaxlab wrote differently (``remat
        = false``) as what it means now."""
        from jaxlab.config import load_config

        return run_identity(load_config(self.config_path, environ={})) == run_identity(cfg)

    def load_config(self, *, env_may_change: Sequence[str] | None = None) -> JaxlabConfig:
        """The run's config; JAXLAB_* variables still apply (e.g. the distributed launch).

        ``env_may_change`` (dotted prefixes): the only fields a variable may change, for a
        caller that continues this very run (resume, eval: ``PER_PROCESS_FIELDS``). A
        variable that changes any other field is a ``ConfigError`` naming the field, both
        values and the variable, and the fix. None: any field (generate and serve take
        their sections from the run's checkpoint and let ``inference.*`` and ``runtime.*``
        vary).
        """
        from jaxlab.config import ConfigError, env_overrides, resolve_config

        if not self.exists():
            raise FileNotFoundError(f"{self.path} is not a run directory (no config.toml)")
        if env_may_change is None:
            return resolve_config(self.config_path).config
        resolved, overrides = env_overrides(self.config_path)
        bad = [o for o in overrides if not _under(o.key, env_may_change)]
        if bad:
            raise ConfigError(
                [
                    f"env {o.variable}: {o.key} = {_show(o.value)}, but this run was created "
                    f"with {o.key} = {_show(o.stored)} ({self.config_path}) and keeps it; "
                    f"unset {o.variable} to use this run, or start a new one with it "
                    "(jaxlab train --run-dir NEW_DIR)"
                    for o in bad
                ]
            )
        return resolved.config

    def write_manifest(self, cfg: JaxlabConfig, extra: dict[str, Any] | None = None) -> None:
        from jaxlab.runtime.inventory import device_inventory, git_state

        inv = device_inventory()
        manifest = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": sys.argv,
            "config_hash": config_hash(cfg),
            "versions": inv.pop("versions"),
            "devices": inv,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "jaxlab_env": {
                k: ("***" if "API_KEY" in k else v)
                for k, v in sorted(os.environ.items())
                if k.startswith("JAXLAB_")
            },
            "git": git_state(),
            **(extra or {}),
        }
        _atomic_write(self.manifest_path, json.dumps(manifest, indent=2, default=str))

    def append_metrics(self, *records: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            for r in records:
                f.write(json.dumps(r, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read_metrics(self) -> Iterator[dict[str, Any]]:
        if not self.metrics_path.is_file():
            return
        with self.metrics_path.open() as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    def loss_history(self) -> dict[int, float]:
        """step -> loss; a step logged again after a resume supersedes the earlier line."""
        out: dict[int, float] = {}
        for r in self.read_metrics():
            if r.get("event") == "step":
                out[int(r["step"])] = float(r["loss"])
        return dict(sorted(out.items()))
