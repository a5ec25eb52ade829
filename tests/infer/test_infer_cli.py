"""``jaxlab generate`` through the real CLI, on a tiny run trained once for this module."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``jaxlab train`` on ``tiny`` for 20 steps, run in-process (same code as the CLI's,
    without a second interpreter start-up)."""
    from jaxlab.config import resolve_config
    from jaxlab.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("generate")
    path = tmp / "run"
    sets = [
        f"runtime.artifacts_dir={tmp / 'art'}",
        "tokenizer.kind=byte",
        "model.vocab_size=258",
        "data.synthetic_docs=200",
        "data.seq_len=32",
        "train.steps=20",
        "checkpoint.every_steps=20",
        "train.eval_batches=1",
    ]
    trainer = Trainer(resolve_config("tiny", sets).config, path)
    try:
        assert trainer.run(20).steps == 20
    finally:
        trainer.close()
    return path


def generate(run_dir: Path, *args: str):
    return run_cli("generate", "--run-dir", str(run_dir), *args)


def test_generate_json_stream_and_no_kv_cache_agree(run_dir):
    """``--stream --json``: the text streams to stderr as it is decoded, the JSON document
    (stdout) holds the non-streamed result; ``--no-kv-cache`` gives the same tokens."""
    r = generate(run_dir, "--prompt", PROMPT, "--max-new-tokens", "24", "--stream", "--json")
    assert r.returncode == 0, r.stderr
    doc = r.json()
    for key in (
        "text",
        "token_ids",
        "prompt_tokens",
        "generated_tokens",
        "ttft_s",
        "prefill_s",
        "decode_s",
        "tokens_per_s",
        "compiles",
        "bucket",
        "checkpoint_step",
        "platform",
        "precision",
    ):
        assert key in doc, key
    assert r.stderr.startswith(doc["text"] + "\n")  # streamed == non-streamed text
    assert doc["prompt_tokens"] == len(PROMPT.encode())  # byte tokenizer
    assert doc["generated_tokens"] == len(doc["token_ids"]) <= 24
    assert doc["compiles"]["prefill"] == 1 and doc["compiles"]["generate"] == 1
    assert doc["bucket"] == 32 and doc["checkpoint_step"] == 20
    assert doc["platform"] == "cpu" and doc["precision"] == "float32"
    assert doc["ttft_s"] > 0 and doc["tokens_per_s"] > 0

    naive = generate(run_dir, "--prompt", PROMPT, "--max-new-tokens", "24", "--no-kv-cache")
    assert naive.returncode == 0, naive.stderr
    assert naive.stdout == doc["text"] + "\n"


def test_compilation_cache_dir_serves_a_second_run(run_dir, tmp_path):
    """``runtime.compilation_cache_dir``: the first run writes its executables, a second
    identical run loads every one of them (``compile_cache_hits``; JAX writes an entry only
    on a miss, so nothing is added or rewritten) and answers the same. jaxlab still counts
    each load as that function's compile."""
    cache = tmp_path / "xla-cache"
    env = {"JAXLAB_RUNTIME__COMPILATION_CACHE_DIR": str(cache)}
    args = ("--prompt", PROMPT, "--max-new-tokens", "8", "--json")
    first = run_cli("generate", "--run-dir", str(run_dir), *args, env=env)
    assert first.returncode == 0, first.stderr
    assert first.json()["compile_cache_hits"] == 0
    written = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert any("generate" in name for name in written), sorted(written)
    second = run_cli("generate", "--run-dir", str(run_dir), *args, env=env)
    assert second.returncode == 0, second.stderr
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == written
    assert second.json()["token_ids"] == first.json()["token_ids"]
    compiles = second.json()["compiles"]
    assert compiles == first.json()["compiles"] and compiles["prefill"] == compiles["generate"] == 1
    assert second.json()["compile_cache_hits"] == sum(compiles.values())


def test_generate_bad_input_exits_2(run_dir, tmp_path):
    r = generate(run_dir)
    assert r.returncode == 2 and "no prompt" in r.stderr
    f = tmp_path / "p.txt"
    f.write_text("hi")
    r = generate(run_dir, "--prompt", "x", "--prompt-file", str(f))
    assert r.returncode == 2 and "not both" in r.stderr
    r = generate(tmp_path, "--prompt", "x")
    assert r.returncode == 2 and "not a run directory" in r.stderr
    r = generate(run_dir, "--prompt-file", str(f), "--max-new-tokens", "127")
    assert r.returncode == 2
    assert "inference.max_len = 128" in r.stderr and "129" in r.stderr
    assert "Traceback" not in r.stderr


def test_load_run_restores_the_params_alone(run_dir):
    """Inference reads only the ``params`` subtree of the checkpoint: the same arrays as the
    full train-state restore, no optimizer built, the step and tokenizer recorded."""
    import jax
    import numpy as np

    from jaxlab.checkpoint import Checkpointer
    from jaxlab.infer import load_run

    run = load_run(run_dir)
    assert run.step == 20 and run.tokenizer.n_vocab == 258
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ck:
        full, _ = ck.restore(20, None)
    want = jax.tree.leaves(full["params"])
    got = jax.tree.leaves(run.params)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any(
        "opt" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(run.params)
    )


@pytest.mark.slow
def test_generate_speculative_gives_plain_greedy_tokens_and_reports_acceptance(run_dir):
    """``--speculative ngram`` and ``--speculative draft:RUN`` (the run drafting for itself:
    every draft is its own argmax) give plain greedy's tokens, and say what they drafted."""
    args = ("--prompt", "abcabcabcabcabcabc", "--max-new-tokens", "40", "--json")
    plain = generate(run_dir, *args)
    assert plain.returncode == 0, plain.stderr
    assert plain.json()["speculative"] is None
    want = plain.json()["token_ids"]
    for choice in ("ngram", f"draft:{run_dir}"):
        r = generate(run_dir, *args, "--speculative", choice)
        assert r.returncode == 0, r.stderr
        doc = r.json()
        assert doc["token_ids"] == want, choice
        spec = doc["speculative"]
        assert spec["method"] == choice.split(":")[0]
        assert spec["draft_tokens"] > 0 and isinstance(spec["switched_off"], bool)
        if choice.startswith("draft"):
            assert spec["accepted_tokens"] == spec["draft_tokens"]
            assert spec["acceptance_rate"] == 1.0
        assert doc["compiles"]["spec_generate"] == 1


def test_generate_speculative_bad_choices_exit_2(run_dir, tmp_path):
    r = generate(run_dir, "--prompt", "x", "--speculative", "medusa")
    assert (
        r.returncode == 2 and "--speculative 'medusa'" in r.stderr and "draft:RUN_DIR" in r.stderr
    )
    r = generate(run_dir, "--prompt", "x", "--speculative", f"draft:{tmp_path}")
    assert r.returncode == 2 and "--speculative" in r.stderr and "not a run directory" in r.stderr
    r = generate(run_dir, "--prompt", "x", "--speculative", "ngram", "--no-kv-cache")
    assert r.returncode == 2 and "cannot speculate" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_draft_of_another_tokenizer_is_refused_naming_both():
    from jaxlab.config import JaxlabConfig, ModelConfig, TokenizerConfig
    from jaxlab.infer.speculative import draft_problem
    from jaxlab.tokenizer import bpe_tokenizer, byte_tokenizer

    tok = TokenizerConfig(kind="byte")
    cfg = JaxlabConfig(model=ModelConfig(vocab_size=300, max_seq_len=64), tokenizer=tok)
    byte, bpe = byte_tokenizer(), bpe_tokenizer(["hello world " * 50], 300)
    problem = draft_problem("runs/d", cfg, byte, cfg, bpe)
    assert problem is not None
    assert "runs/d" in problem and byte.sha256[:12] in problem and bpe.sha256[:12] in problem
    assert "tokenizer.path" in problem
    assert draft_problem("runs/d", cfg, byte, cfg, byte) is None
    other = cfg.model_copy(update={"model": ModelConfig(vocab_size=512, max_seq_len=64)})
    assert "model.vocab_size = 512" in (draft_problem("runs/d", cfg, byte, other, byte) or "")
    short = cfg.model_copy(update={"model": ModelConfig(vocab_size=300, max_seq_len=32)})
    assert "max_seq_len = 32" in (draft_problem("runs/d", cfg, byte, short, byte) or "")


def test_a_draft_run_is_checked_before_loading(tmp_path):
    """What a command checks before jax starts: a run directory, and its saved tokenizer's
    hash against the target's."""
    import json

    from jaxlab.infer.speculative.draft import draft_dir_problem

    def fake_run(name: str, sha: str):
        d = tmp_path / name
        (d / "checkpoints").mkdir(parents=True)
        (d / "tokenizer").mkdir()
        (d / "tokenizer" / "tokenizer.json").write_text(json.dumps({"sha256": sha}))
        return d

    target, same, other = fake_run("t", "a" * 64), fake_run("s", "a" * 64), fake_run("o", "b" * 64)
    assert draft_dir_problem(target, same) is None
    problem = draft_dir_problem(target, other) or ""
    assert "bbbbbbbbbbbb" in problem and "aaaaaaaaaaaa" in problem and "tokenizer.path" in problem
    assert "not a run directory" in (draft_dir_problem(target, tmp_path / "none") or "")


def test_generate_takes_inference_overrides_but_not_model_ones(run_dir):
    """inference.* and runtime.* come from JAXLAB_* variables and --set over the run's config
    (--set last); the model's sections are the checkpoint's, and overriding one is exit 2."""
    args = ("--prompt", PROMPT, "--max-new-tokens", "4", "--json")
    env = {"JAXLAB_INFERENCE__PREFILL_BUCKETS": "[64]"}
    by_env = run_cli("generate", "--run-dir", str(run_dir), *args, env=env)
    assert by_env.returncode == 0, by_env.stderr
    assert by_env.json()["bucket"] == 64  # the run's config says [32, ...]
    by_set = run_cli(
        "generate",
        "--run-dir",
        str(run_dir),
        *args,
        "--set",
        "inference.prefill_buckets=[128]",
        env=env,
    )
    assert by_set.returncode == 0, by_set.stderr
    assert by_set.json()["bucket"] == 128
    assert by_set.json()["token_ids"] == by_env.json()["token_ids"]
    bad = generate(run_dir, *args, "--set", "model.n_layers=1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--set model.n_layers=1" in bad.stderr and "inference.*, runtime.*" in bad.stderr
