"""KV cache: prefill + decode through the cache reproduces the full-sequence forward.

This is the model-level invariant the inference engine relies on: for every row, the logits
of a right-padded prefill (cache_index 0) and of each following single-token decode step
(cache_index = positions = the row's current length, ragged across rows) equal the logits
of one plain causal forward over the whole sequence, within f32 tolerance.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.model import KVCache, Transformer, apply, init_kv_cache, split_model

F32 = PrecisionConfig()
ATOL = RTOL = 2e-5


def tiny(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=53, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_mlp=48, max_seq_len=32
    )
    base.update(overrides)
    return ModelConfig(**base)


CONFIGS = {
    "rope-gqa-einsum": tiny(),
    "learned-mqa-xla-tied-gelu": tiny(
        positions="learned", n_kv_heads=1, attention_impl="xla", tie_embeddings=True, mlp="gelu"
    ),
}


def random_params(abstract: nnx.State, seed: int) -> nnx.State:
    """Numpy-drawn parameters (std 1/sqrt(fan_in), norm gains 1 + noise); no jax compile."""
    rng = np.random.default_rng(seed)

    def leaf(x: jax.ShapeDtypeStruct) -> jax.Array:
        if len(x.shape) == 1:
            value = 1.0 + 0.1 * rng.standard_normal(x.shape)
        else:
            value = rng.standard_normal(x.shape) / np.sqrt(x.shape[0])
        return jnp.asarray(value.astype(np.float32)).astype(x.dtype)

    return jax.tree.map(leaf, abstract)


class CachedModel:
    """Jitted full forward and jitted cached step (cache donated, as an engine would)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        model = nnx.eval_shape(lambda: Transformer(cfg, F32, rngs=nnx.Rngs(0)))
        graphdef, abstract = split_model(model)
        self.params = random_params(abstract, seed=0)

        def full(params: nnx.State, tokens: jax.Array) -> jax.Array:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            return apply(graphdef, params, tokens, positions)[0]

        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(
            params: nnx.State,
            cache: KVCache,
            tokens: jax.Array,
            positions: jax.Array,
            cache_index: jax.Array,
        ) -> tuple[jax.Array, KVCache]:
            logits, new_cache = apply(
                graphdef, params, tokens, positions, kv_cache=cache, cache_index=cache_index
            )
            assert new_cache is not None
            return logits, new_cache

        self.full = jax.jit(full)
        self.step = step

    def run_full(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.full(self.params, jnp.asarray(tokens, jnp.int32)))

    def run_step(
        self, cache: KVCache, tokens: np.ndarray, positions: np.ndarray, cache_index: np.ndarray
    ) -> tuple[np.ndarray, KVCache]:
        logits, cache = self.step(
            self.params,
            cache,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            jnp.asarray(cache_index, jnp.int32),
        )
        return np.asarray(logits), cache


_MODELS: dict[str, CachedModel] = {}


def cached_model(name: str) -> CachedModel:
    if name not in _MODELS:
        _MODELS[name] = CachedModel(CONFIGS[name])
    return _MODELS[name]


MAX_LEN, BUCKET, N_DECODE = 16, 8, 6
PROMPT_LENS = np.array([3, 8, 5])  # ragged; row 1 fills the whole bucket


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_full_forward(name: str) -> None:
    m = cached_model(name)
    b = len(PROMPT_LENS)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, m.cfg.vocab_size, size=(b, MAX_LEN))
    full = m.run_full(seq)

    # Prefill: right-padded prompts (junk after each prompt), all rows from slot 0.
    prompt = rng.integers(0, m.cfg.vocab_size, size=(b, BUCKET))
    for r, n in enumerate(PROMPT_LENS):
        prompt[r, :n] = seq[r, :n]
    positions = np.broadcast_to(np.arange(BUCKET), (b, BUCKET))
    cache = init_kv_cache(m.cfg, b, MAX_LEN, jnp.float32)
    logits, cache = m.run_step(cache, prompt, positions, np.zeros(b, np.int32))
    assert logits.shape == (b, BUCKET, m.cfg.vocab_size)
    assert logits.dtype == np.float32
    for r, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(logits[r, :n], full[r, :n], atol=ATOL, rtol=RTOL)

    # Decode one token per row per step; each row at its own position (ragged).
    for j in range(N_DECODE):
        pos = PROMPT_LENS + j
        tok = seq[np.arange(b), pos][:, None]
        logits, cache = m.run_step(cache, tok, pos[:, None], pos)
        assert logits.shape == (b, 1, m.cfg.vocab_size)
        np.testing.assert_allclose(
            logits[:, 0], full[np.arange(b), pos], atol=ATOL, rtol=RTOL, err_msg=f"step {j}"
        )

    assert isinstance(cache, KVCache)
    assert cache.n_layers == m.cfg.n_layers
    assert cache.k[0].shape == (b, MAX_LEN, m.cfg.n_kv_heads, m.cfg.head_dim)


def test_ragged_chunked_prefill_matches_full_forward() -> None:
    # Second chunk starts at a different slot per row (rewriting a slot with the same token
    # at the same position is harmless): prefill may be split into chunks.
    m = cached_model("rope-gqa-einsum")
    b, chunk = 3, 4
    rng = np.random.default_rng(2)
    seq = rng.integers(0, m.cfg.vocab_size, size=(b, MAX_LEN))
    full = m.run_full(seq)
    cache = init_kv_cache(m.cfg, b, MAX_LEN)
    first_pos = np.broadcast_to(np.arange(chunk), (b, chunk))
    logits, cache = m.run_step(cache, seq[:, :chunk], first_pos, np.zeros(b, np.int32))
    np.testing.assert_allclose(logits, full[:, :chunk], atol=ATOL, rtol=RTOL)

    starts = np.array([4, 2, 3])
    pos = starts[:, None] + np.arange(chunk)
    toks = np.take_along_axis(seq, pos, axis=1)
    logits, cache = m.run_step(cache, toks, pos, starts)
    np.testing.assert_allclose(
        logits, np.take_along_axis(full, pos[..., None], axis=1), atol=ATOL, rtol=RTOL
    )


def test_init_kv_cache_layout_and_dtype() -> None:
    cfg = tiny(n_layers=3, n_kv_heads=1)
    cache = init_kv_cache(cfg, batch=2, max_len=5, dtype=jnp.bfloat16)
    assert (cache.n_layers, cache.batch_size, cache.max_len) == (3, 2, 5)
    assert len(cache.k) == len(cache.v) == 3
    for a in (*cache.k, *cache.v):
        assert a.shape == (2, 5, 1, cfg.head_dim)
        assert a.dtype == jnp.bfloat16
    # A pytree: tree ops see the 2 * n_layers buffers.
    assert len(jax.tree.leaves(cache)) == 6


def test_cache_and_segment_ids_are_exclusive() -> None:
    cfg = tiny(n_layers=1)
    model = nnx.eval_shape(lambda: Transformer(cfg, F32, rngs=nnx.Rngs(0)))
    graphdef, abstract = split_model(model)
    cache = init_kv_cache(cfg, 1, 8)
    t = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        jax.eval_shape(
            lambda p: apply(graphdef, p, t, t, kv_cache=cache, cache_index=t[:, 0], segment_ids=t),
            abstract,
        )
    with pytest.raises(ValueError, match="cache_index"):
        jax.eval_shape(lambda p: apply(graphdef, p, t, t, kv_cache=cache), abstract)
