"""The training knobs that must not change the function: every remat policy and scan over
layers give the unrolled, un-checkpointed model's loss and gradients (on CPU)."""

from __future__ import annotations

from typing import Any, get_args

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlab.config import load_config
from jaxlab.config.schema import ModelConfig, PrecisionConfig, RematPolicy
from jaxlab.infer import Engine, SamplingParams
from jaxlab.infer.offline import generate
from jaxlab.infer.request import Request
from jaxlab.model import make_model, split_model
from jaxlab.model.remat import POLICIES
from jaxlab.model.transformer import StackedBlocks, is_stacked, unstack_params
from jaxlab.parallel.rules import _names, logical_axes
from jaxlab.train.step import token_losses

F32 = PrecisionConfig()


def tiny(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=61, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, d_mlp=48, max_seq_len=32
    )
    base.update(overrides)
    return ModelConfig(**base)


def batch(b: int = 2, t: int = 12, seed: int = 3) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 61, size=(b, t + 1))
    # Two packed documents per row: segments and restarting positions are exercised too.
    seg = np.where(np.arange(t) < t // 2, 1, 2)[None].repeat(b, 0)
    pos = np.where(seg == 1, np.arange(t), np.arange(t) - t // 2)
    return {
        "tokens": jnp.asarray(toks[:, :-1], jnp.int32),
        "targets": jnp.asarray(toks[:, 1:], jnp.int32),
        "positions": jnp.asarray(pos, jnp.int32),
        "segment_ids": jnp.asarray(seg, jnp.int32),
        "loss_mask": jnp.ones((b, t), jnp.float32),
    }


def loss_and_grads(graphdef: nnx.GraphDef, params: nnx.State, key: jax.Array | None = None):
    def loss(p: nnx.State) -> jax.Array:
        total, n, _ = token_losses(graphdef, p, batch(), key)
        return total / n

    return jax.jit(jax.value_and_grad(loss))(params)


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_the_policies_are_the_configs():
    assert get_args(RematPolicy) == POLICIES


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_every_remat_policy_gives_the_reference_loss_and_grads(policy):
    cfg = tiny()
    ref_graph, params = split_model(make_model(cfg, F32, seed=0))
    graph, again = split_model(make_model(cfg, F32, seed=0, remat=policy))
    assert_trees_close(params, again, rtol=0, atol=0)
    ref_loss, ref_grads = loss_and_grads(ref_graph, params)
    loss, grads = loss_and_grads(graph, params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(grads, ref_grads)


def test_a_boolean_remat_is_full_or_none():
    assert make_model(tiny(), F32, 0, remat=True).remat == "full"
    assert make_model(tiny(), F32, 0, remat=False).remat == "none"
    with pytest.raises(ValueError, match="unknown remat policy"):
        make_model(tiny(), F32, 0, remat="everything")


@pytest.mark.parametrize("policy", ["none", "full", "save_qkv_proj"])
@pytest.mark.parametrize("precision", [F32, PrecisionConfig(compute_dtype="bfloat16")])
def test_scan_over_layers_is_the_unrolled_model(policy, precision):
    cfg = tiny()
    scan_cfg = cfg.model_copy(update={"scan_layers": True})
    ref_graph, params = split_model(make_model(cfg, precision, seed=0))
    graph, stacked = split_model(make_model(scan_cfg, precision, 0, remat=policy))
    # The same initialisation: the scanned model's blocks are the unrolled ones, stacked.
    flat_graph, flat = unstack_params(scan_cfg, precision, stacked)
    assert_trees_close(flat, params, rtol=0, atol=0)
    leaf = stacked["blocks"]["stacked"]["attn"]["w_qkv"][...]
    assert leaf.shape == (cfg.n_layers, *params["blocks"][0]["attn"]["w_qkv"][...].shape)

    tol = 1e-5 if precision.compute_dtype == "float32" else 2e-2
    ref_loss, ref_grads = loss_and_grads(ref_graph, params)
    loss, grads = loss_and_grads(graph, stacked)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=tol)
    flat_grads = unstack_params(scan_cfg, precision, grads)[1]
    assert_trees_close(flat_grads, ref_grads, rtol=tol, atol=tol * 1e-2)
    assert jax.tree.structure(nnx.state(nnx.merge(flat_graph, flat))) == jax.tree.structure(params)


def test_scan_keeps_dropout_keys_per_layer():
    cfg = tiny(dropout_rate=0.3)
    ref_graph, params = split_model(make_model(cfg, F32, seed=0))
    scan_cfg = cfg.model_copy(update={"scan_layers": True})
    graph, stacked = split_model(make_model(scan_cfg, F32, seed=0))
    key = jax.random.PRNGKey(7)
    ref_loss, ref_grads = loss_and_grads(ref_graph, params, key)
    loss, grads = loss_and_grads(graph, stacked, key)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(unstack_params(scan_cfg, F32, grads)[1], ref_grads)


def test_scan_prefill_and_decode_match_the_unrolled_model():
    cfg = tiny()
    ref = make_model(cfg, F32, seed=0)
    scanned = make_model(cfg.model_copy(update={"scan_layers": True}), F32, seed=0)
    # The stacked blocks read as a list of blocks: per-layer views of the same values.
    assert isinstance(scanned.blocks, StackedBlocks) and len(scanned.blocks) == cfg.n_layers
    for view, block in zip(scanned.blocks, ref.blocks, strict=True):
        assert_trees_close(nnx.state(view), nnx.state(block), rtol=0, atol=0)
    assert scanned.blocks[-1].attn.kernel_name == ref.blocks[0].attn.kernel_name
    with pytest.raises(IndexError):
        scanned.blocks[cfg.n_layers]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 8)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    h0, c0 = ref.prefill(tokens, positions, 16)
    h1, c1 = scanned.prefill(tokens, positions, 16)
    np.testing.assert_allclose(np.asarray(h1), np.asarray(h0), rtol=1e-5, atol=1e-6)
    assert_trees_close(c1, c0)
    nxt, pos = tokens[:, -1], jnp.array([8, 8])
    d0, _ = ref.decode(nxt, pos, c0)
    d1, _ = scanned.decode(nxt, pos, c1)
    np.testing.assert_allclose(np.asarray(d1), np.asarray(d0), rtol=1e-5, atol=1e-6)


def test_an_engine_decodes_a_scan_model_unrolled():
    sets = ["model.vocab_size=258", "tokenizer.kind=byte", "inference.prefill_buckets=[16]"]
    ref_cfg = load_config("tiny", sets, environ={})
    scan_cfg = load_config("tiny", [*sets, "model.scan_layers=true"], environ={})
    ref, eng = Engine.from_config(ref_cfg, seed=0), Engine.from_config(scan_cfg, seed=0)
    # The engine unstacks once: its params are the unrolled model's, layer by layer.
    assert not is_stacked(eng.params)
    assert_trees_close(eng.params, ref.params, rtol=0, atol=0)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    reqs = [Request.create([5, 6, 7, 8], sp, ref.limits())]
    assert generate(eng, reqs)[0].token_ids == generate(ref, reqs)[0].token_ids


def test_stacked_params_get_a_replicated_layer_axis():
    scanned = nnx.eval_shape(
        lambda: make_model(tiny().model_copy(update={"scan_layers": True}), F32, 0)
    )
    axes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(scanned, nnx.Param)):
        axes["/".join(_names(path))] = logical_axes(path, tuple(leaf.shape))
    assert axes["blocks/stacked/attn/w_qkv"] == ("layers", "embed", "qkv")
    assert axes["blocks/stacked/mlp/w_down"] == ("layers", "mlp", "embed")
    assert axes["blocks/stacked/attn_norm/scale"] == ("layers", "norm")
    assert axes["embed/table"] == ("vocab", "embed")
