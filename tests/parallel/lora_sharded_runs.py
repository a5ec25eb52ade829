"""Train a tiny base once, then LoRA on it under several meshes; print losses and adapters.

Invoked by tests/parallel/test_lora_sharding.py in a subprocess (simulated devices need
their own process):
    python lora_sharded_runs.py OUT_DIR MESH [MESH ...]      MESH = data,fsdp,tensor
The base (OUT_DIR/base) is trained on the first call's first mesh and reused afterwards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from sharded_runs import SETS  # the same tiny run as the full-training meshes

from jaxlab.config import load_config
from jaxlab.train import base as base_run
from jaxlab.train.trainer import Trainer

STEPS = 4


def cfg_for(out: Path, mesh: str, *extra: str):
    d, f, t = mesh.split(",")
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={out / 'art'}",
            *SETS,
            f"parallel.data={d}",
            f"parallel.fsdp={f}",
            f"parallel.tensor={t}",
            *extra,
        ],
        environ={},
    )


def main() -> None:
    out = Path(sys.argv[1])
    base_dir = out / "base"
    if not base_dir.exists():
        with Trainer(cfg_for(out, sys.argv[2]), base_dir) as base:
            base.run(stop_at=2)
    for mesh in sys.argv[2:]:
        name = mesh.replace(",", "x")
        lora = [
            f"train.init_from={base_dir}",
            "train.lora.rank=4",
            'train.lora.targets=["q","k","v","o","mlp"]',
            "train.lora.dropout=0.1",
            "train.optimizer.learning_rate=1e-2",
        ]
        cfg = cfg_for(out, mesh, *lora)
        ref, base_cfg = base_run.resolve(base_dir)
        with Trainer(base_run.adopt(cfg, base_cfg, ref), out / f"lora-{name}") as t:
            t.run(stop_at=STEPS)
            losses = {
                str(r["step"]): r["loss"]
                for r in t.run_dir.read_metrics()
                if r.get("event") == "step"
            }
            adapter = {
                jax.tree_util.keystr(p): np.asarray(jax.device_get(x))
                for p, x in jax.tree_util.tree_leaves_with_path(t.state["params"])
            }
            specs = sorted({str(x.sharding.spec) for x in jax.tree.leaves(t.base_params)})
        np.savez(out / f"{name}.npz", **adapter)  # pyright: ignore[reportArgumentType]
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "base_specs": specs}))


if __name__ == "__main__":
    main()
