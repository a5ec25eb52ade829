"""LoRA at the model level: a zero ``B`` is the base model exactly, a merged model is base plus
adapter, scan equals unrolled, and a batch mixing adapters (and base rows) gives every row
what that row gives alone, in the sequence forward and the cached (prefill/decode) one."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.kernels.rows import Rows
from jaxlab.model import lora, make_model, split_model
from jaxlab.model.quant import quantize_dense

F32 = PrecisionConfig()
TARGETS = ("q", "k", "v", "o", "mlp")
SETTINGS = settings(max_examples=4, deadline=None, derandomize=True)


def tiny(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=61, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_mlp=48, max_seq_len=32
    )
    base.update(overrides)
    return ModelConfig(**base)


def inputs(b: int = 3, t: int = 8, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    toks = np.random.default_rng(seed).integers(0, 61, (b, t))
    return jnp.asarray(toks, jnp.int32), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def trained_like(cfg: ModelConfig, rank: int, targets: tuple[str, ...], seed: int) -> lora.Weights:
    """An adapter whose ``B`` is not zero (as after training)."""
    w = lora.init_weights(cfg, rank, targets, jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 100)
    return {
        n: {"a": p["a"], "b": 0.05 * jax.random.normal(jax.random.fold_in(key, i), p["b"].shape)}
        for i, (n, p) in enumerate(w.items())
    }


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: Any, params: Any, tokens: jax.Array, positions: jax.Array, adapters: Any):
    return nnx.merge(graphdef, params)(tokens, positions, lora=adapters)


def logits(model: Any, tokens: jax.Array, positions: jax.Array, adapters: Any = None) -> np.ndarray:
    """The jitted forward (one compile per graph, shapes and adapter layout)."""
    graphdef, params = split_model(model)
    return np.asarray(_forward(graphdef, params, tokens, positions, adapters))


@functools.partial(jax.jit, static_argnums=0)
def _prefill_decode(graphdef: Any, params: Any, tokens, positions, nxt, pos, adapters: Any):
    model = nnx.merge(graphdef, params)
    h, cache = model.prefill(tokens, positions, 16, lora=adapters)
    d, _ = model.decode(nxt, pos, cache, lora=adapters)
    return model.logits(h[:, -1]), model.logits(d)


@SETTINGS
@given(
    targets=st.lists(st.sampled_from(TARGETS), min_size=1, max_size=5, unique=True),
    scan=st.booleans(),
    mlp=st.sampled_from(["swiglu", "gelu"]),
)
def test_a_fresh_adapter_is_the_base_model_exactly(targets, scan, mlp):
    cfg = tiny(scan_layers=scan, mlp=mlp)
    model = make_model(cfg, F32, seed=0)
    tokens, positions = inputs()
    w = lora.init_weights(cfg, 4, targets, jax.random.PRNGKey(1))
    assert all(float(jnp.abs(p["a"]).sum()) > 0 for p in w.values())  # only B is zero
    base = logits(model, tokens, positions)
    adapted = logits(model, tokens, positions, lora.Lora.single(w, 2.0))
    np.testing.assert_array_equal(adapted, base)


@pytest.mark.parametrize("scan", [False, True])
def test_a_merged_model_is_base_plus_adapter(scan):
    cfg = tiny(scan_layers=scan)
    model = make_model(cfg, F32, seed=0)
    tokens, positions = inputs()
    w = trained_like(cfg, 4, TARGETS, seed=2)
    adapted = logits(model, tokens, positions, lora.Lora.single(w, 1.5))
    graphdef, params = split_model(model)
    pure = lora.merge(cfg, nnx.to_pure_dict(params), w, 1.5)
    nnx.replace_by_pure_dict(params, pure)
    merged = logits(nnx.merge(graphdef, params), tokens, positions)
    assert not np.allclose(adapted, logits(make_model(cfg, F32, 0), tokens, positions), atol=1e-3)
    np.testing.assert_allclose(merged, adapted, rtol=1e-4, atol=1e-4)


def test_scan_over_layers_applies_each_layers_adapter():
    cfg = tiny()
    tokens, positions = inputs()
    w = trained_like(cfg, 4, ("q", "o", "mlp"), seed=3)
    key = jax.random.PRNGKey(9)
    adapters = lora.Lora.single(w, 2.0, dropout_key=key, dropout_rate=0.25)
    flat = logits(make_model(cfg, F32, 0), tokens, positions, adapters)
    scanned = logits(make_model(tiny(scan_layers=True), F32, 0), tokens, positions, adapters)
    np.testing.assert_allclose(scanned, flat, rtol=1e-5, atol=1e-5)


def test_stacking_puts_a_zero_adapter_in_slot_zero_and_pads_ranks():
    cfg = tiny()
    w1, w2 = trained_like(cfg, 2, ("q",), 1), trained_like(cfg, 4, ("v", "mlp"), 2)
    weights, scale = lora.stack(cfg, [(w1, 1.0), (w2, 0.5)])
    assert set(weights) == {"q", "v", "mlp_in", "mlp_down"}
    assert weights["q"]["a"].shape == (cfg.n_layers, 3, cfg.d_model, 4)
    np.testing.assert_array_equal(np.asarray(scale), [0.0, 1.0, 0.5])
    for p in weights.values():
        assert float(jnp.abs(p["a"][:, lora.NO_ADAPTER]).max()) == 0.0
    assert float(jnp.abs(weights["v"]["b"][:, 1]).max()) == 0.0  # adapter 1 has no v


@SETTINGS
@given(ids=st.lists(st.integers(0, 2), min_size=4, max_size=4), scan=st.booleans())
def test_a_mixed_adapter_batch_gives_each_row_its_own_adapters_result(ids, scan):
    cfg = tiny(scan_layers=scan)
    model = make_model(cfg, F32, seed=0)
    w1, w2 = trained_like(cfg, 2, ("q", "k", "o"), 1), trained_like(cfg, 4, ("v", "mlp"), 2)
    weights, scale = lora.stack(cfg, [(w1, 2.0), (w2, 0.5)])
    tokens, positions = inputs(b=4, seed=5)
    mixed = logits(model, tokens, positions, lora.Lora(weights, scale, jnp.asarray(ids)))
    alone = {0: None, 1: lora.Lora.single(w1, 2.0), 2: lora.Lora.single(w2, 0.5)}
    for row, i in enumerate(ids):
        one = logits(model, tokens[row : row + 1], positions[row : row + 1], alone[i])
        np.testing.assert_allclose(mixed[row : row + 1], one, rtol=1e-5, atol=1e-5)


def test_a_mixed_adapter_batch_decodes_each_row_with_its_adapter():
    """Prefill, then decode against the cache, with per-row adapters: each row as alone."""
    cfg = tiny()
    model = make_model(cfg, F32, seed=0)
    w1, w2 = trained_like(cfg, 2, TARGETS, 1), trained_like(cfg, 3, ("q", "mlp"), 2)
    weights, scale = lora.stack(cfg, [(w1, 2.0), (w2, 1.0)])
    ids = jnp.asarray([2, 0, 1], jnp.int32)
    tokens, positions = inputs(b=3, t=6, seed=7)
    nxt, pos = jnp.asarray([3, 4, 5], jnp.int32), jnp.full((3,), 6, jnp.int32)

    graphdef, params = split_model(model)

    def run(rows: slice, adapters: Any) -> tuple[np.ndarray, ...]:
        out = _prefill_decode(
            graphdef, params, tokens[rows], positions[rows], nxt[rows], pos[rows], adapters
        )
        return tuple(np.asarray(o) for o in out)

    mixed = run(slice(None), lora.Lora(weights, scale, ids))
    alone = {0: None, 1: lora.Lora.single(w1, 2.0), 2: lora.Lora.single(w2, 1.0)}
    for row, i in enumerate(np.asarray(ids)):
        one = run(slice(row, row + 1), alone[int(i)])
        for m, o in zip(mixed, one, strict=True):
            np.testing.assert_allclose(m[row : row + 1], o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "save_qkv_out_proj"])
def test_remat_keeps_the_adapted_loss_and_adapter_grads(policy):
    cfg = tiny()
    tokens, positions = inputs()
    w = trained_like(cfg, 4, TARGETS, seed=4)

    def grads(model: Any) -> tuple[Any, Any]:
        graphdef, params = split_model(model)

        def loss(weights: Any) -> jax.Array:
            m = nnx.merge(graphdef, params)
            return jnp.mean(m(tokens, positions, lora=lora.Lora.single(weights, 2.0)) ** 2)

        return jax.jit(jax.value_and_grad(loss))(w)

    ref_loss, ref = grads(make_model(cfg, F32, 0))
    got_loss, got = grads(make_model(cfg, F32, 0, remat=policy))
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_adapters_sit_on_int8_weights_too():
    """The int8 inference path (QuantizedKernel) takes adapters: a zero B is the int8 model."""
    cfg = tiny()
    graphdef, params = split_model(make_model(cfg, F32, 0))
    qmodel = nnx.merge(graphdef, quantize_dense(params))
    tokens, positions = inputs()
    w = lora.init_weights(cfg, 4, TARGETS, jax.random.PRNGKey(1))
    base = np.asarray(qmodel(tokens, positions))
    np.testing.assert_array_equal(
        np.asarray(qmodel(tokens, positions, lora=lora.Lora.single(w, 2.0))), base
    )
    trained = trained_like(cfg, 4, TARGETS, seed=2)
    assert not np.allclose(
        np.asarray(qmodel(tokens, positions, lora=lora.Lora.single(trained, 2.0))), base
    )


def test_row_buckets_slice_the_adapter_ids_with_the_rows():
    """A decode step that computes only the leading rows (``Rows``) gives them their own
    adapters: the ids are sliced with the rows."""
    cfg = tiny()
    model = make_model(cfg, F32, seed=0)
    graphdef, params = split_model(model)
    w1, w2 = trained_like(cfg, 2, TARGETS, 1), trained_like(cfg, 2, ("q", "mlp"), 2)
    weights, scale = lora.stack(cfg, [(w1, 2.0), (w2, 1.0)])
    tokens, positions = inputs(b=4, t=6, seed=8)
    nxt, pos = jnp.asarray([3, 4, 5, 6], jnp.int32), jnp.full((4,), 6, jnp.int32)

    @jax.jit
    def step(params: Any, active: jax.Array, adapters: Any) -> jax.Array:
        m = nnx.merge(graphdef, params)
        _, cache = m.prefill(tokens, positions, 16, lora=adapters)
        rows = Rows.up_to_last(active, (1, 4))
        d, _ = m.decode(nxt, pos, cache, rows=rows, lora=adapters)
        return m.logits(d)

    ids = jnp.asarray([2, 1, 0, 1], jnp.int32)
    one_row = step(params, jnp.asarray([True, False, False, False]), lora.Lora(weights, scale, ids))
    all_rows = step(params, jnp.ones((4,), bool), lora.Lora(weights, scale, ids))
    np.testing.assert_allclose(
        np.asarray(one_row[0]), np.asarray(all_rows[0]), rtol=1e-5, atol=1e-5
    )
    assert float(jnp.abs(one_row[1:]).max()) == 0.0  # rows not computed come out as zeros
