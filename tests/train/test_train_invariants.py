"""Training invariants: accumulation, exact resumption, kill mid-save, eval weighting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlab.config import JaxlabConfig, load_config
from jaxlab.data import TokenStore, eval_batches
from jaxlab.model import make_model, split_model
from jaxlab.runtime.compiled import ShapeKeyedJit
from jaxlab.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from jaxlab.train.run_dir import RunDir
from jaxlab.train.step import init_state, make_eval_step, make_train_step
from jaxlab.train.trainer import Trainer, TrainObserver, evaluate_params


def tiny_cfg(tmp_path: Path, *overrides: str) -> JaxlabConfig:
    return load_config(
        "tiny",
        [
            f"runtime.artifacts_dir={tmp_path / 'art'}",
            "tokenizer.kind=byte",
            "model.vocab_size=258",
            "data.synthetic_docs=400",
            "data.seq_len=32",
            "train.steps=40",
            "train.log_every_steps=1",
            "train.schedule.warmup_steps=5",
            "checkpoint.every_steps=5",
            *overrides,
        ],
        environ={},
    )


def leaves_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_grad_accumulation_equals_large_batch():
    cfg = load_config("tiny", ["model.vocab_size=258", "tokenizer.kind=byte"], environ={})
    model = make_model(cfg.model, cfg.train.precision, seed=0)
    graphdef, params = split_model(model)
    tx = make_optimizer(cfg.train)
    sched = learning_rate_schedule(cfg.train)
    rng = np.random.default_rng(0)
    b, t = 8, 16
    tokens = rng.integers(0, 258, (b, t + 1))
    mask = (rng.random((b, t)) > 0.2).astype(np.float32)  # uneven real-token counts per row
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
        "segment_ids": jnp.ones((b, t), jnp.int32),
        "loss_mask": jnp.asarray(mask),
    }
    results = {}
    for k in (1, 4):
        step = jax.jit(make_train_step(graphdef, tx, sched, grad_accum_steps=k, dropout=False))
        state, metrics = step(init_state(params, tx, 0), batch)
        results[k] = (state, metrics)
    (s1, m1), (s4, m4) = results[1], results[4]
    # Stated tolerance: f32 summation order differs between one sum and four partial sums.
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


def test_decay_mask_excludes_norms_and_embeddings():
    cfg = load_config("tiny", environ={})
    _, params = split_model(make_model(cfg.model, cfg.train.precision, seed=0))
    flat = jax.tree_util.tree_leaves_with_path(decay_mask(params))
    by_name = {"/".join(str(getattr(k, "key", k)) for k in path): v for path, v in flat}
    assert any(v for v in by_name.values())
    for name, v in by_name.items():
        if "embed" in name or "norm" in name:
            assert not v, name


@pytest.mark.slow
def test_exact_resumption_bitwise(tmp_path):
    cfg = tiny_cfg(tmp_path)
    full = Trainer(cfg, tmp_path / "full")
    full.run(stop_at=20)
    full.close()

    first = Trainer(cfg, tmp_path / "split")
    first.run(stop_at=10)
    first.close()
    second = Trainer(cfg, tmp_path / "split")
    assert second.restore("latest") == 10
    second.run(stop_at=20)
    second.close()

    assert leaves_equal(full.state["params"], second.state["params"])
    assert leaves_equal(full.state["opt_state"], second.state["opt_state"])
    assert RunDir(tmp_path / "full").loss_history() == RunDir(tmp_path / "split").loss_history()


KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from jaxlab.config import from_toml
    from jaxlab.train.trainer import Trainer, TrainObserver

    class KillOnSecondSave(TrainObserver):
        saves = 0
        def on_checkpoint(self, step):
            self.saves += 1
            if self.saves == 2:  # the async save of step 10 is in flight right now
                os.kill(os.getpid(), signal.SIGKILL)

    run_dir = sys.argv[1]
    cfg = from_toml(open(sys.argv[2]).read())
    Trainer(cfg, run_dir, observer=KillOnSecondSave()).run(stop_at=20)
    """
)


@pytest.mark.slow
def test_sigkill_during_async_save_resumes_from_last_complete(tmp_path):
    from jaxlab.config import to_toml

    cfg = tiny_cfg(tmp_path)
    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(to_toml(cfg))
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SAVE, str(killed), str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == -9, proc.stderr[-2000:]

    resumed = Trainer(cfg, killed)
    latest = resumed.restore("latest")
    assert latest in (5, 10)  # never a partial step directory
    resumed.run(stop_at=20)
    resumed.close()

    full = Trainer(cfg, tmp_path / "full")
    full.run(stop_at=20)
    full.close()
    assert leaves_equal(full.state["params"], resumed.state["params"])
    assert leaves_equal(full.state["opt_state"], resumed.state["opt_state"])


def test_eval_weights_by_real_tokens_not_padding():
    cfg = load_config("tiny", ["model.vocab_size=258", "tokenizer.kind=byte"], environ={})
    model = make_model(cfg.model, cfg.train.precision, seed=0)
    graphdef, params = split_model(model)
    rng = np.random.default_rng(1)
    docs = [list(rng.integers(0, 255, int(n))) for n in rng.integers(5, 60, 40)]
    store = TokenStore.from_documents(docs[:2], docs, n_vocab=258, eot_id=256, pad_id=257)
    eval_fn = ShapeKeyedJit(make_eval_step(graphdef), name="eval")
    seq = 16
    # Batch sizes 3 and 8 give different amounts of padding in the last batch.
    a = evaluate_params(eval_fn, params, store, seq, 3, 1000)
    b = evaluate_params(eval_fn, params, store, seq, 8, 1000)
    assert a["tokens"] == b["tokens"]
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
    # And both equal the plain mean over real tokens computed batch by batch here.
    total = n = 0.0
    for batch in eval_batches(store, seq, 5, 1000):
        out = eval_fn(params, {k: jnp.asarray(v) for k, v in batch.items()})
        total += float(out["loss_sum"])
        n += float(batch["loss_mask"].sum())
    np.testing.assert_allclose(a["loss"], total / n, rtol=1e-6)
    assert a["tokens"] == n


def test_skip_policy_counts_and_keeps_state(tmp_path):
    cfg = tiny_cfg(
        tmp_path,
        "train.nonfinite_policy=skip",
        "train.optimizer.learning_rate=1e30",
        "train.optimizer.clip_norm=0",
    )
    t = Trainer(cfg, tmp_path / "skip")
    summary = t.run(stop_at=8)
    t.close()
    assert summary.skipped_steps > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(t.state["params"]))


@pytest.mark.parametrize("k", [2])
def test_remat_gives_the_same_step(k, tmp_path):
    cfg = load_config("tiny", ["model.vocab_size=258", "tokenizer.kind=byte"], environ={})
    outs = []
    for remat in (False, True):
        model = make_model(cfg.model, cfg.train.precision, seed=0, remat=remat)
        graphdef, params = split_model(model)
        tx = make_optimizer(cfg.train)
        step = jax.jit(
            make_train_step(
                graphdef, tx, learning_rate_schedule(cfg.train), grad_accum_steps=k, dropout=False
            )
        )
        b, t = 4, 8
        toks = jnp.arange(b * (t + 1)).reshape(b, t + 1) % 250
        batch = {
            "tokens": toks[:, :-1].astype(jnp.int32),
            "targets": toks[:, 1:].astype(jnp.int32),
            "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
            "segment_ids": jnp.ones((b, t), jnp.int32),
            "loss_mask": jnp.ones((b, t), jnp.float32),
        }
        outs.append(step(init_state(params, tx, 0), batch)[1]["loss"])
    np.testing.assert_allclose(float(outs[0]), float(outs[1]), rtol=1e-6)


class Recorder(TrainObserver):
    def __init__(self):
        self.events: list[str] = []

    def on_event(self, message: str) -> None:
        self.events.append(message)


def test_compile_is_timed_and_logged_once(tmp_path):
    cfg = tiny_cfg(tmp_path)
    rec = Recorder()
    t = Trainer(cfg, tmp_path / "c", observer=rec)
    t.run(stop_at=6)
    t.close()
    assert t.step_fn.compiles == 1
    compiles = [r for r in RunDir(tmp_path / "c").read_metrics() if r.get("event") == "compile"]
    assert len(compiles) == 1
    assert compiles[0]["compile_s"] > 0 and compiles[0]["trace_s"] > 0
    assert any("compiled train_step" in e for e in rec.events)


def test_the_eval_step_uses_the_train_steps_head_blocks(tmp_path, monkeypatch):
    """``train.loss_chunk_tokens`` reaches the eval step too (the losses are the same at any
    block size; the block size is what a TPU's eval pays for)."""
    import jaxlab.train.step as step_module

    seen: list[int] = []
    real = step_module.token_losses

    def spy(*args, **kwargs):
        seen.append(kwargs["loss_chunk_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(step_module, "token_losses", spy)
    t = Trainer(tiny_cfg(tmp_path, "train.loss_chunk_tokens=8"), tmp_path / "run")
    t.evaluate(max_batches=1)
    t.close()
    assert seen and set(seen) == {8}
