"""int8 weights and the int8 KV pool through the engine's paged path, on a tiny run trained
once for this module (60 steps: peaked enough that greedy tokens mean something), and
``jaxlab eval --weights int8`` on the same run through the real CLI.

Tolerances, measured on this run and kept with a margin (docs/quantization.md has the
figures for a bench-small run):

* greedy tokens of int8 weights, of the int8 pool, and of both equal float's on at least
  90% of positions (1.0 measured);
* with the int8 pool, a decode step's logits stay within ``KV_LOGIT_ATOL`` = 0.03 of the
  float pool's while both decode the same tokens (at most 0.006 measured, logits of
  magnitude about 4).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cli
from flax import nnx

from jaxlab.infer import Chunk, Engine, Request, SamplingParams, load_run, offline
from jaxlab.infer.steps import decode_step
from jaxlab.model.quant import QuantizedKernel

PROMPTS = ["The quick brown fox", "Once upon a time", "In 1999 the", "def main():"]
NEW_TOKENS = 24
MIN_AGREEMENT = 0.9
KV_LOGIT_ATOL = 0.03


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``jaxlab train`` on ``tiny`` (byte tokenizer) for 60 steps, in-process."""
    from jaxlab.config import resolve_config
    from jaxlab.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("int8")
    sets = [
        f"runtime.artifacts_dir={tmp / 'art'}",
        "tokenizer.kind=byte",
        "model.vocab_size=258",
        "data.synthetic_docs=200",
        "data.seq_len=32",
        "train.steps=60",
        "checkpoint.every_steps=60",
        "train.eval_batches=2",
    ]
    trainer = Trainer(resolve_config("tiny", sets).config, tmp / "run")
    try:
        assert trainer.run(60).steps == 60
    finally:
        trainer.close()
    return tmp / "run"


@pytest.fixture(scope="module")
def engines(run_dir: Path) -> dict[str, Engine]:
    run = load_run(run_dir)
    out = {}
    for name, inference in {
        "float": {},
        "int8": {"weights": "int8"},
        "int8_kv": {"kv_cache_dtype": "int8"},
    }.items():
        cfg = run.cfg.model_copy(deep=True)
        for field, value in inference.items():
            setattr(cfg.inference, field, value)
        out[name] = Engine(run.graphdef, run.params, cfg)
    out["tokenizer"] = run.tokenizer  # type: ignore[assignment]
    return out


def greedy_tokens(engine: Engine, tokenizer) -> list[list[int]]:
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [Request.create(tokenizer.encode(p), sp, engine.limits()) for p in PROMPTS]
    return [g.token_ids for g in offline.generate(engine, requests)]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = [x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return float(np.mean(same))


@pytest.mark.slow
def test_int8_weights_decode_through_the_pages_and_agree_with_float(engines):
    fp, q = engines["float"], engines["int8"]
    kernels = [
        v for _, v in nnx.to_flat_state(q.params) if isinstance(v.get_value(), QuantizedKernel)
    ]
    assert len(kernels) == 4 * fp.cfg.model.n_layers + 1  # every dense layer + untied head
    assert all(k.get_value().values.dtype == jnp.int8 for k in kernels)
    # int8 values, a float32 scale per output channel, float32 norms: near a quarter.
    assert q.step_weight_bytes < 0.3 * fp.step_weight_bytes
    want = greedy_tokens(fp, engines["tokenizer"])
    got = greedy_tokens(q, engines["tokenizer"])
    assert q.compiles["generate"] == 1 and q.paged_kernel == fp.paged_kernel
    assert agreement(want, got) >= MIN_AGREEMENT


@pytest.mark.slow
def test_an_int8_pool_decodes_close_to_the_float_pool(engines):
    """The same prompts through the float pool and the int8 pool, one decode step at a time
    (pages read step by step, as the engine reads an int8 pool): the greedy tokens agree,
    and where they do the logits are within ``KV_LOGIT_ATOL``."""
    fp, q = engines["float"], engines["int8_kv"]
    assert q.kv_cache_dtype == "int8" and q.page_bytes < 0.4 * fp.page_bytes
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [engines["tokenizer"].encode(p) for p in PROMPTS]
    states = []
    for eng in (fp, q):
        pages = eng.max_pages
        state = eng.init_decode_state(len(prompts), len(prompts) * pages)
        chunks = [
            Chunk(p, 0, list(range(i * pages, (i + 1) * pages)), sp) for i, p in enumerate(prompts)
        ]
        state, pre = eng.prefill(state, chunks)
        states.append(eng.insert(pre, state, list(range(len(prompts)))))
    assert states[1].cache.pools[0].k.dtype == jnp.int8
    step = jax.jit(decode_step, static_argnums=(0,), static_argnames=("buckets",))
    steps, agreed = 12, 0
    in_step = np.ones(len(prompts), bool)  # rows whose every token so far agreed
    for _ in range(steps):
        (sf, lf, ef), (sq, lq, eq) = (
            step(eng.graphdef, eng.weights(), st, buckets=False)
            for eng, st in zip((fp, q), states, strict=True)
        )
        in_step &= np.asarray(ef) == np.asarray(eq)
        if in_step.any():
            diff = np.abs(np.asarray(lf) - np.asarray(lq))[in_step]
            assert diff.max() <= KV_LOGIT_ATOL, diff.max()
        agreed += int(in_step.sum())
        states = [sf, sq]
    assert agreed >= MIN_AGREEMENT * steps * len(prompts)


@pytest.mark.slow
def test_eval_reports_int8_perplexity_and_greedy_agreement(run_dir):
    r = run_cli("eval", "--run-dir", str(run_dir), "--weights", "int8", "--json")
    assert r.returncode == 0, r.stderr
    doc = r.json()
    q = doc["int8"]
    assert q["activations"] == "float" and q["tokens"] == doc["tokens"] > 0
    assert abs(q["perplexity_ratio"] - 1) <= 0.01  # the bar, on this tiny run too
    assert q["perplexity_ratio"] == pytest.approx(q["perplexity"] / doc["perplexity"])
    assert MIN_AGREEMENT <= q["greedy_agreement"] <= 1.0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--weights", "int4"], "'int4', expected 'float' or 'int8'"),
        (["--activations", "int8"], "--activations int8 quantizes the input of int8 weights"),
    ],
)
def test_eval_rejects_unknown_formats_with_exit_2(tmp_path, args, needle):
    """Checked before the run is opened (a directory that is not a run is fine)."""
    r = run_cli("eval", "--run-dir", str(tmp_path), *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert "--weights" in r.stderr or "--activations" in r.stderr


@pytest.mark.parametrize(
    "override, needle",
    [
        ("inference.weights=int4", "inference.weights: Input should be 'float' or 'int8'"),
        ("inference.kv_cache_dtype=fp8", "inference.kv_cache_dtype: Input should be 'compute'"),
        ("inference.activations=int8", "inference.activations: 'int8' quantizes the input"),
    ],
)
def test_unknown_dtypes_are_config_errors_naming_the_field(override, needle):
    r = run_cli("config", "show", "--config", "tiny", "--set", override)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--set: {needle}" in r.stderr
