"""The LoRA path through the real CLI: train a base, ``train --from`` it with LoRA, ``merge``,
``generate`` from the merged run; and the usage errors on the way (exit 2, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_cli
from flax import nnx

from jaxlab.infer.load import load_run
from jaxlab.model import lora
from jaxlab.train import base as base_run
from jaxlab.train.adapter import load_adapter

pytestmark = pytest.mark.slow


def sets(tmp_path: Path, *more: str) -> list[str]:
    common = [
        f"runtime.artifacts_dir={tmp_path / 'art'}",
        "data.seq_len=32",
        "data.synthetic_docs=200",
        "train.log_every_steps=5",
        "checkpoint.every_steps=5",
        "train.eval_batches=1",
        *more,
    ]
    return [x for s in common for x in ("--set", s)]


def test_train_from_with_lora_then_merge_then_generate(tmp_path):
    base, tuned, merged = tmp_path / "base", tmp_path / "lora", tmp_path / "merged"
    byte = sets(tmp_path, "tokenizer.kind=byte", "model.vocab_size=258")
    r = run_cli("train", "-c", "tiny", *byte, "--steps", "5", "--run-dir", str(base), "--json")
    assert r.returncode == 0, r.stderr

    # The LoRA run names the base, takes its model and tokenizer, and trains a new source.
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps({"text": f"abc abd {i % 3}. "}) + "\n" for i in range(300)))
    lora_sets = sets(
        tmp_path,
        "data.source=jsonl",
        f"data.paths=[{str(data)!r}]",
        "train.lora.rank=4",
        'train.lora.targets=["q","v","mlp"]',
        "train.optimizer.learning_rate=1e-2",
    )
    r = run_cli(
        "train", "-c", "tiny", "--from", str(base), *lora_sets, "--steps", "5",
        "--run-dir", str(tuned), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.json()["steps"] == 5
    ref = base_run.read_record(tuned)
    assert ref == base_run.resolve(base)[0]
    manifest = json.loads((tuned / "manifest.json").read_text())
    assert manifest["base"] == ref.to_json() and manifest["trainable"] == "lora"

    r = run_cli("merge", "--run-dir", str(tuned), "--out", str(merged), "--json")
    assert r.returncode == 0, r.stderr
    assert r.json()["merged_from"]["base"] == ref.to_json()

    # The merged checkpoint is the base plus the adapter, as a full run.
    adapter = load_adapter(tuned)
    ref, base_cfg = base_run.resolve(base)
    base_params = nnx.to_pure_dict(base_run.load_params(ref, base_cfg))
    run = load_run(merged)
    assert run.step == 5 and run.cfg.train.lora is None and run.cfg.train.init_from is None
    expected = lora.merge(base_cfg.model, base_params, adapter.weights, adapter.scale)
    got = nnx.to_pure_dict(run.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert not np.allclose(
        np.asarray(got["blocks"][0]["attn"]["w_qkv"]),
        np.asarray(
            nnx.to_pure_dict(base_run.load_params(ref, base_cfg))["blocks"][0]["attn"]["w_qkv"]
        ),
    )
    # The merged run reads like any other.
    r = run_cli(
        "generate", "--run-dir", str(merged), "--prompt", "abc", "--max-new-tokens", "4",
        "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = r.json()
    assert doc["checkpoint_step"] == 5 and 1 <= doc["generated_tokens"] <= 4

    # Usage errors: a base that is no run, a merge of a run that is not LoRA, LoRA with no base.
    r = run_cli(
        "train", "-c", "tiny", "--from", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "x")
    )
    assert r.returncode == 2 and "not a run directory" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("merge", "--run-dir", str(base), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "not a LoRA run" in r.stderr
    r = run_cli(
        "train", "-c", "tiny", "--set", "train.lora.rank=4", "--run-dir", str(tmp_path / "z")
    )
    assert r.returncode == 2 and "--from BASE_RUN_DIR" in r.stderr
