"""bf16 parameters with f32 master weights (``train.precision.master_dtype``) against f32
parameters: the same loss, the gradients to bf16 rounding, the update applied to the f32
copy, and a run that saves, resumes and serves like any other (on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlab.config import ConfigError, load_config
from jaxlab.train.optimizer import learning_rate_schedule, make_optimizer
from jaxlab.train.step import cast_tree, init_state, initial_params, make_train_step

SETS = [
    "model.vocab_size=258",
    "tokenizer.kind=byte",
    "train.precision.compute_dtype=bfloat16",
    "train.optimizer.clip_norm=0",
]
MASTER = ["train.precision.param_dtype=bfloat16", "train.precision.master_dtype=float32"]


def batch(b: int = 4, t: int = 16) -> dict[str, jax.Array]:
    toks = np.random.default_rng(1).integers(0, 250, size=(b, t + 1))
    return {
        "tokens": jnp.asarray(toks[:, :-1], jnp.int32),
        "targets": jnp.asarray(toks[:, 1:], jnp.int32),
        "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
        "segment_ids": jnp.ones((b, t), jnp.int32),
        "loss_mask": jnp.ones((b, t), jnp.float32),
    }


def steps(cfg, params, n: int, *, master: bool, accum: int = 1):
    tx = make_optimizer(cfg.train)
    step = jax.jit(
        make_train_step(
            # The graphdef does not depend on the dtypes the params arrive in.
            initial_params(cfg.model, cfg.train.precision, 0)[0],
            tx,
            learning_rate_schedule(cfg.train),
            grad_accum_steps=accum,
            dropout=False,
        )
    )
    state = init_state(params, tx, 0, param_dtype=jnp.bfloat16 if master else None)
    losses = []
    for _ in range(n):
        state, metrics = step(state, batch())
        losses.append(float(metrics["loss"]))
    return state, losses


def test_master_dtype_must_be_wider_than_the_params():
    with pytest.raises(ConfigError, match="master weights must be wider"):
        load_config("tiny", ["train.precision.master_dtype=float32"], environ={})
    cfg = load_config("tiny", [*MASTER, "train.precision.master_dtype=none"], environ={})
    assert cfg.train.precision.master_dtype is None


@pytest.mark.parametrize("accum", [1, 2])
def test_master_weights_follow_the_f32_reference(accum):
    ref_cfg = load_config("tiny", SETS, environ={})
    cfg = load_config("tiny", [*SETS, *MASTER], environ={})
    _, init = initial_params(cfg.model, cfg.train.precision, 0)
    # The initial master copy is the f32 model's own draw.
    ref_init = initial_params(ref_cfg.model, ref_cfg.train.precision, 0)[1]
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(ref_init), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Start both from values bf16 holds exactly: the models then read the same weights.
    exact = cast_tree(cast_tree(init, jnp.bfloat16), jnp.float32)
    # One step: the same forward, the same block gradients (a bf16 dot's, widened); the
    # table's and the head's gradients may differ in rounding. So the f32 master weights
    # are the reference's parameters, to within AdamW's first step (about lr per entry).
    ref_one, _ = steps(ref_cfg, exact, 1, master=False, accum=accum)
    one, _ = steps(cfg, exact, 1, master=True, accum=accum)
    lr0 = float(np.asarray(learning_rate_schedule(cfg.train)(0)))
    ref_leaves = jax.tree.leaves(ref_one["params"])
    for (path, m), r in zip(
        jax.tree_util.tree_leaves_with_path(one["master"]), ref_leaves, strict=True
    ):
        m, r = np.asarray(m), np.asarray(r)
        assert np.max(np.abs(m - r)) <= 2 * lr0, jax.tree_util.keystr(path)
        # The blocks' gradients are a bf16 dot's either way; the table's (a scatter) and the
        # head's (summed inside the fused loss) are produced in the params' dtype.
        if "blocks" in jax.tree_util.keystr(path):
            assert np.mean(m == r) > 0.99, jax.tree_util.keystr(path)

    ref_state, ref_losses = steps(ref_cfg, exact, 3, master=False, accum=accum)
    state, losses = steps(cfg, exact, 3, master=True, accum=accum)

    assert losses[0] == ref_losses[0]  # bf16 compute on identical weights: the same loss
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    master, params = state["master"], state["params"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(master))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    # The model's params are the master weights rounded; the optimizer state is the master's.
    for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(m.astype(jnp.bfloat16)), np.asarray(p))
    mu = jax.tree.leaves(state["opt_state"])
    assert {x.dtype for x in mu if x.ndim >= 1} == {jnp.dtype(jnp.float32)}
    # Updates accumulate in f32: below bf16's resolution, the master moved where the
    # rounded params could not show it.
    moved = [
        np.any(np.asarray(m) != np.asarray(p.astype(jnp.float32)))
        for m, p in zip(jax.tree.leaves(master), jax.tree.leaves(params), strict=True)
    ]
    assert any(moved)
    assert ref_state["step"] == state["step"] == 3


def test_a_master_weights_run_resumes_exactly_and_serves_bf16(tmp_path):
    from jaxlab.infer.load import load_run
    from jaxlab.train.trainer import Trainer

    sets = [
        *SETS,
        *MASTER,
        "train.steps=6",
        "checkpoint.every_steps=3",
        f"runtime.artifacts_dir={tmp_path / 'artifacts'}",
    ]
    cfg = load_config("tiny", sets, environ={})
    straight = Trainer(cfg, tmp_path / "a")
    straight.run(stop_at=6)
    straight.close()
    first = Trainer(cfg, tmp_path / "b")
    first.run(stop_at=3)
    first.close()
    again = Trainer(cfg, tmp_path / "b")
    assert again.restore() == 3
    again.run(stop_at=6)
    again.close()
    for key in ("params", "master", "opt_state"):
        for x, y in zip(
            jax.tree.leaves(straight.state[key]), jax.tree.leaves(again.state[key]), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    run = load_run(tmp_path / "b")
    assert {x.dtype for x in jax.tree.leaves(run.params)} == {jnp.dtype(jnp.bfloat16)}
