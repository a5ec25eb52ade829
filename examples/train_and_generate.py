"""Train a tiny model and generate from it through the library API, without the CLI.

python examples/train_and_generate.py [RUN_DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from jaxlab.config import load_config
from jaxlab.infer import Engine, Request, SamplingParams, load_run, offline
from jaxlab.runtime import configure_platform
from jaxlab.train.trainer import Trainer


def main() -> None:
    # What the CLI does first: pick the platform and jaxlab's XLA:CPU flag defaults
    # (docs/performance.md) before JAX starts a backend. Optional; "auto" keeps JAX's choice.
    configure_platform("auto")
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "run"
    # The same loader the CLI uses: preset < env < overrides. The chat tokens let a server
    # on this run answer /v1/chat/completions too (examples/openai_chat.py).
    cfg = load_config(
        "tiny",
        [
            "train.steps=150",
            "checkpoint.every_steps=50",
            "tokenizer.chat_tokens=true",
            f"runtime.artifacts_dir={run_dir.parent}",
        ],
    )
    trainer = Trainer(cfg, run_dir)
    summary = trainer.run()
    trainer.close()
    print(f"trained {summary.steps} steps: loss {summary.final_loss:.3f}, eval {summary.eval}")

    # Inference: restore the params (no optimizer state), build the engine, and check each
    # request once against the model and its tokenizer.
    run = load_run(run_dir)
    engine = Engine(run.graphdef, run.params, run.cfg)
    limits = engine.limits(run.tokenizer.eot_id)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=32, temperature=0.8, top_k=20, seed=7)
    requests = [
        Request.create(run.tokenizer.encode("count: 3 4 5"), greedy, limits),
        Request.create(run.tokenizer.encode("the cat"), sampled, limits),
    ]
    for result in offline.generate(engine, requests, tokenizer=run.tokenizer):
        print(repr(result.text))
    print("compiles:", engine.compiles)


if __name__ == "__main__":
    main()
