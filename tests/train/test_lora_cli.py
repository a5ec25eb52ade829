"""The LoRA path through the real CLI: train a base, ``train --from`` it with LoRA, ``merge``,
``generate`` from the merged run, then ``serve`` the base with the trained adapter and check
that it answers as the merged run and the base do; and the usage errors on the way (exit 2,
no traceback)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from conftest import ROOT, clean_env, run_cli
from flax import nnx

from jaxlab.infer.load import load_run
from jaxlab.model import lora
from jaxlab.train import base as base_run
from jaxlab.train.adapter import load_adapter

pytestmark = pytest.mark.slow

#: Enough for the adapter to change greedy output from the base's (fewer left both giving
#: the base's blanks), so serving it can be told apart from serving the base.
LORA_STEPS = 30


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
        "train.optimizer.learning_rate=3e-2",
    )
    r = run_cli(
        "train", "-c", "tiny", "--from", str(base), *lora_sets, "--steps", str(LORA_STEPS),
        "--run-dir", str(tuned), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.json()["steps"] == LORA_STEPS
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
    assert run.step == LORA_STEPS and run.cfg.train.lora is None and run.cfg.train.init_from is None
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
    # The real server: the base with the trained adapter as model ``ft``, one start.
    # Greedy, EOS allowed on both sides; one prefill bucket for generate and serve alike, so
    # both run the same shapes. The adapter served unmerged (x W + s x A B) and the merged
    # weights (x (W + s A B)) differ by float rounding only; the trained adapter moves the
    # logits far more than that, so eight greedy tokens are stable.
    one_bucket = ("--set", "inference.prefill_buckets=[32]")
    prompt, max_tokens = "abc abd 1. abc a", 8

    def generated(run_dir: Path) -> dict[str, Any]:
        r = run_cli(
            "generate", "--run-dir", str(run_dir), "--prompt", prompt, "--max-new-tokens",
            str(max_tokens), *one_bucket, "--json",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.json()

    # The merged run reads like any other; its answer is also the served adapter's reference.
    doc = generated(merged)
    assert doc["checkpoint_step"] == LORA_STEPS and 1 <= doc["generated_tokens"] <= max_tokens
    want_ft, want_base = doc["text"], generated(base)["text"]
    assert want_ft != want_base  # else the comparison could not tell the adapter was applied
    port_file, err_path = tmp_path / "port", tmp_path / "serve.stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "jaxlab", "serve", "--run-dir", str(base),
                "--adapter", f"ft={tuned}", "--host", "127.0.0.1", "--port", "0",
                "--port-file", str(port_file), "--slots", "2", *one_bucket,
            ],
            stdout=subprocess.DEVNULL, stderr=err, env=clean_env(), cwd=ROOT,
        )  # fmt: skip
        try:
            url = _wait_ready(proc, port_file, err_path)
            models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
            assert [m["id"] for m in models] == ["jaxlab", "ft"]

            def served(model: str) -> str:
                body: dict[str, Any] = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                r = httpx.post(url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            assert served("ft") == want_ft
            assert served("jaxlab") == want_base
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, err_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in err_path.read_text()

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


def _wait_ready(proc: subprocess.Popen[bytes], port_file: Path, err: Path) -> str:
    """The server's URL once ``/ready`` says 200 (start-up compiles; a loaded 2-core VM)."""
    t_end = time.monotonic() + 600
    while not port_file.exists() or not port_file.read_text().strip():
        assert proc.poll() is None and time.monotonic() < t_end, err.read_text()
        time.sleep(0.05)
    url = f"http://127.0.0.1:{int(port_file.read_text())}"
    while True:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < t_end, err.read_text()
        time.sleep(0.1)
