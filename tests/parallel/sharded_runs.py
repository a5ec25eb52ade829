"""Run the same tiny training under several meshes; print losses and final params.

Invoked by tests/parallel in a subprocess (simulated devices need their own process):
    python sharded_runs.py OUT_DIR MESH [MESH ...]      MESH = data,fsdp,tensor
A MESH of 'restore:A>B' trains 3 steps on mesh A, checkpoints, restores on mesh B and
continues to 5 steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxlab.config import load_config
from jaxlab.train.trainer import Trainer

STEPS = 5
#: The run every mesh trains (beside its artifacts dir and mesh); the two-process test
#: trains it too, and compares with this script's single-device losses.
SETS = [
    "tokenizer.kind=byte",
    "model.vocab_size=258",
    "data.synthetic_docs=200",
    "data.seq_len=32",
    "train.log_every_steps=1",
    "train.schedule.warmup_steps=2",
]


def cfg_for(out: Path, mesh: str):
    d, f, t = mesh.split(",")
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={out / 'art'}",
            *SETS,
            f"parallel.data={d}",
            f"parallel.fsdp={f}",
            f"parallel.tensor={t}",
        ],
        environ={},
    )


def dump(out: Path, name: str, trainer: Trainer) -> None:
    losses = {
        str(r["step"]): r["loss"]
        for r in trainer.run_dir.read_metrics()
        if r.get("event") == "step"
    }
    params = {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
        for p, x in jax.tree_util.tree_leaves_with_path(trainer.state["params"])
    }
    np.savez(out / f"{name}.npz", **params)  # pyright: ignore[reportArgumentType]
    specs = sorted(
        {str(x.sharding.spec) for x in jax.tree.leaves(trainer.state["params"])}  # type: ignore[attr-defined]
    )
    (out / f"{name}.json").write_text(json.dumps({"losses": losses, "specs": specs}))


def main() -> None:
    out = Path(sys.argv[1])
    for mesh in sys.argv[2:]:
        name = mesh.replace(",", "x").replace(":", "_").replace(">", "-")
        if mesh.startswith("restore:"):
            a, b = mesh.removeprefix("restore:").split(">")
            first = Trainer(cfg_for(out, a), out / f"run-{name}")
            first.run(stop_at=3)
            first.close()
            # Same run directory, same config except the mesh: restore reshards.
            cfg_b = cfg_for(out, b)
            (out / f"run-{name}" / "config.toml").unlink()
            second = Trainer(cfg_b, out / f"run-{name}")
            second.restore("latest")
            second.run(stop_at=STEPS)
            second.close()
            dump(out, name, second)
        else:
            t = Trainer(cfg_for(out, mesh), out / f"run-{name}")
            t.run(stop_at=STEPS)
            t.close()
            dump(out, name, t)


if __name__ == "__main__":
    main()
