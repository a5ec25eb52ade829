"""The model's cached modes reproduce its sequence forward, with every attention kernel.

This is the model-level invariant the inference engine relies on: for every row, the logits
of a right-padded prefill and of each following one-token decode step (each row at its own
position, ragged), and of a chunk that extends a cache from a different slot per row,
equal the logits of one plain causal forward over the whole sequence, within f32 tolerance.
Each kernel keeps the cache in its own layout; the model never looks inside. The same holds
for a paged cache (pages scattered through a shuffled pool), read by each kernel's paged
counterpart, with and without row buckets.
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
from jaxlab.kernels import KERNELS, PAGED_FOR
from jaxlab.kernels.paged import Pages
from jaxlab.kernels.rows import Rows
from jaxlab.model import Cache, Transformer, split_model

F32 = PrecisionConfig()
ATOL = RTOL = 2e-5


def tiny(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=53, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_mlp=48, max_seq_len=32
    )
    base.update(overrides)
    return ModelConfig(**base)


CONFIGS = {
    "rope-gqa-xla_cpu": tiny(attention_impl="xla_cpu"),
    "rope-gqa-reference": tiny(attention_impl="reference"),
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
    """Jitted full forward, prefill, and cached extension (cache donated, as an engine does)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        model = nnx.eval_shape(lambda: Transformer(cfg, F32, rngs=nnx.Rngs(0)))
        graphdef, abstract = split_model(model)
        self.params = random_params(abstract, seed=0)

        def full(params: nnx.State, tokens: jax.Array) -> jax.Array:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            return nnx.merge(graphdef, params)(tokens, positions)

        def prefill(params: nnx.State, tokens: jax.Array) -> tuple[jax.Array, Cache]:
            model = nnx.merge(graphdef, params)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            h, cache = model.prefill(tokens, positions, MAX_LEN)
            return model.logits(h), cache

        @functools.partial(jax.jit, donate_argnums=(1,))
        def extend(
            params: nnx.State, cache: Cache, tokens: jax.Array, positions: jax.Array
        ) -> tuple[jax.Array, Cache]:
            model = nnx.merge(graphdef, params)
            if tokens.shape[1] == 1:  # the decode form
                h, cache = model.decode(tokens[:, 0], positions[:, 0], cache)
                return model.logits(h)[:, None], cache
            h, cache = model.extend(tokens, positions, cache)
            return model.logits(h), cache

        @functools.partial(jax.jit, donate_argnums=(1,))
        def prefill_pages(
            params: nnx.State, pages: Pages, tokens: jax.Array
        ) -> tuple[jax.Array, Pages]:
            model = nnx.merge(graphdef, params)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            h, pages = model.prefill_pages(tokens, positions, pages)
            return model.logits(h), pages

        @functools.partial(jax.jit, donate_argnums=(1,), static_argnums=(4,))
        def extend_pages(
            params: nnx.State, pages: Pages, tokens: jax.Array, positions: jax.Array, rows: int
        ) -> tuple[jax.Array, Pages]:
            """``rows`` > 0: compute only that many leading rows (a row bucket)."""
            model = nnx.merge(graphdef, params)
            b = tokens.shape[0]
            sizes = Rows((rows, b), jnp.asarray(0)) if 0 < rows < b else None
            h, pages = model.extend(tokens, positions, pages, rows=sizes)
            return model.logits(h), pages

        self.graphdef = graphdef
        self.full = jax.jit(full)
        self.prefill = jax.jit(prefill)
        self.extend = extend
        self.prefill_pages = prefill_pages
        self.extend_pages = extend_pages

    def run_full(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.full(self.params, jnp.asarray(tokens, jnp.int32)))

    def run_prefill(self, tokens: np.ndarray) -> tuple[np.ndarray, Cache]:
        logits, cache = self.prefill(self.params, jnp.asarray(tokens, jnp.int32))
        return np.asarray(logits), cache

    def run_extend(
        self, cache: Cache, tokens: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, Cache]:
        logits, cache = self.extend(
            self.params, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
        )
        return np.asarray(logits), cache


@functools.cache
def cached_model(name: str) -> CachedModel:
    return CachedModel(CONFIGS[name])


MAX_LEN, BUCKET, N_DECODE = 16, 8, 6
PROMPT_LENS = np.array([3, 8, 5])  # ragged; row 1 fills the whole bucket


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_full_forward(name: str) -> None:
    m = cached_model(name)
    b = len(PROMPT_LENS)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, m.cfg.vocab_size, size=(b, MAX_LEN))
    full = m.run_full(seq)

    # Prefill: right-padded prompts (junk after each prompt), every row from slot 0.
    prompt = rng.integers(0, m.cfg.vocab_size, size=(b, BUCKET))
    for r, n in enumerate(PROMPT_LENS):
        prompt[r, :n] = seq[r, :n]
    logits, cache = m.run_prefill(prompt)
    assert logits.shape == (b, BUCKET, m.cfg.vocab_size)
    assert logits.dtype == np.float32
    for r, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(logits[r, :n], full[r, :n], atol=ATOL, rtol=RTOL)

    # Decode one token per row per step; each row at its own position (ragged). The junk
    # K/V of the padding lies in each row's future and is overwritten before it is seen.
    for j in range(N_DECODE):
        pos = PROMPT_LENS + j
        tok = seq[np.arange(b), pos][:, None]
        logits, cache = m.run_extend(cache, tok, pos[:, None])
        assert logits.shape == (b, 1, m.cfg.vocab_size)
        np.testing.assert_allclose(
            logits[:, 0], full[np.arange(b), pos], atol=ATOL, rtol=RTOL, err_msg=f"step {j}"
        )

    kernel = KERNELS[m.cfg.attention_impl]
    assert len(cache) == m.cfg.n_layers
    k, v = kernel.to_bskd(cache[0])
    assert k.shape == v.shape == (b, MAX_LEN, m.cfg.n_kv_heads, m.cfg.head_dim)


@pytest.mark.parametrize("name", ["rope-gqa-xla_cpu", "rope-gqa-reference"])
def test_ragged_chunked_prefill_matches_full_forward(name: str) -> None:
    """A second chunk extends the cache from a different slot per row (rewriting a slot
    with the same token at the same position is harmless): prefill may come in chunks."""
    m = cached_model(name)
    b, chunk = 3, 4
    rng = np.random.default_rng(2)
    seq = rng.integers(0, m.cfg.vocab_size, size=(b, MAX_LEN))
    full = m.run_full(seq)
    logits, cache = m.run_prefill(seq[:, :chunk])
    np.testing.assert_allclose(logits, full[:, :chunk], atol=ATOL, rtol=RTOL)

    starts = np.array([4, 2, 3])
    pos = starts[:, None] + np.arange(chunk)
    toks = np.take_along_axis(seq, pos, axis=1)
    logits, cache = m.run_extend(cache, toks, pos)
    np.testing.assert_allclose(
        logits, np.take_along_axis(full, pos[..., None], axis=1), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_init_cache_layout_and_dtype(kernel: str) -> None:
    cfg = tiny(n_layers=3, n_kv_heads=1, attention_impl=kernel)
    model = Transformer(cfg, F32, rngs=nnx.Rngs(0))
    cache = jax.eval_shape(lambda: model.init_cache(2, 5, jnp.bfloat16))
    assert len(cache) == 3
    for layer in cache:
        k, v = jax.eval_shape(lambda c: KERNELS[kernel].to_bskd(c), layer)
        assert k.shape == v.shape == (2, 5, 1, cfg.head_dim)
        assert k.dtype == v.dtype == jnp.bfloat16
    assert model.init_cache(1, 4)[0] is not None  # default: the compute dtype


def test_a_cache_of_another_depth_is_refused() -> None:
    cfg = tiny(n_layers=2)
    model = Transformer(cfg, F32, rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 8)[:1]
    t = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="cache has 1 layers, model has 2"):
        jax.eval_shape(lambda c: model.extend(t, t, c), cache)


# ------------------------------------------------------------------------- a paged cache

PAGE_SIZE = 4  # MAX_LEN 16 -> 4 pages per row


def scattered_pages(m: CachedModel, rows: int, seed: int) -> tuple[Pages, int]:
    """An empty paged cache whose rows hold shuffled pages of a pool with spare pages."""
    model = nnx.merge(m.graphdef, m.params)
    max_pages = MAX_LEN // PAGE_SIZE
    num_pages = rows * max_pages + 3
    pages = model.init_pages(rows, num_pages, PAGE_SIZE, MAX_LEN)
    ids = np.random.default_rng(seed).permutation(num_pages)[: rows * max_pages]
    table = jnp.asarray(ids.reshape(rows, max_pages), jnp.int32)
    return Pages(pages.pools, table), num_pages


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_prefill_then_decode_matches_full_forward(name: str) -> None:
    """Prefill into pages, then decode ragged rows, then a chunk per row from a different
    position: the full forward's logits at every step, through each kernel's paged
    counterpart. Row 2 of the last steps is outside a 2-row bucket: it writes nothing."""
    m = cached_model(name)
    b = len(PROMPT_LENS)
    rng = np.random.default_rng(3)
    seq = rng.integers(0, m.cfg.vocab_size, size=(b, MAX_LEN))
    full = m.run_full(seq)
    pages, _ = scattered_pages(m, b, seed=4)
    prompt = rng.integers(0, m.cfg.vocab_size, size=(b, BUCKET))
    for r, n in enumerate(PROMPT_LENS):
        prompt[r, :n] = seq[r, :n]
    logits, pages = m.prefill_pages(m.params, pages, jnp.asarray(prompt, jnp.int32))
    for r, n in enumerate(PROMPT_LENS):
        np.testing.assert_allclose(np.asarray(logits)[r, :n], full[r, :n], atol=ATOL, rtol=RTOL)

    for j in range(3):
        pos = PROMPT_LENS + j
        tok = seq[np.arange(b), pos][:, None]
        logits, pages = m.extend_pages(
            m.params, pages, jnp.asarray(tok, jnp.int32), jnp.asarray(pos[:, None]), 0
        )
        np.testing.assert_allclose(
            np.asarray(logits)[:, 0], full[np.arange(b), pos], atol=ATOL, rtol=RTOL
        )

    # A 2-token chunk per row from its own position, rows 0 and 1 only (a row bucket).
    kernel = PAGED_FOR[m.cfg.attention_impl]
    assert kernel in ("paged_reference", "paged_xla")
    before = [np.asarray(a) for a in jax.tree.leaves(pages.pools)]
    pos = (PROMPT_LENS + 3)[:, None] + np.arange(2)
    pos[2] = [MAX_LEN - 2, MAX_LEN - 1]  # row 2 is not computed: nothing of it lands
    toks = np.take_along_axis(seq, pos, axis=1)
    logits, pages = m.extend_pages(
        m.params, pages, jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32), 2
    )
    want = np.take_along_axis(full, pos[..., None], axis=1)
    np.testing.assert_allclose(np.asarray(logits)[:2], want[:2], atol=ATOL, rtol=RTOL)
    table = np.asarray(pages.table)
    for got, old in zip(jax.tree.leaves(pages.pools), before, strict=True):
        got = np.asarray(got)
        changed = {int(p) for p in np.nonzero(np.any(got != old, axis=(0, 2, 3)))[0]}
        allowed = {int(table[r, p // PAGE_SIZE]) for r in (0, 1) for p in pos[r]}
        assert changed <= allowed
