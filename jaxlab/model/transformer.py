"""The decoder-only Transformer LM and its functional entry points.

Architecture (pre-norm, no biases)::

    x = embed(tokens) [+ pos_table[positions]]            # f32 residual stream
    for each layer:
        x = x + dropout(attn(rms_norm(x)))                 # RoPE inside attn if "rope"
        x = x + dropout(mlp(rms_norm(x)))
    logits = head(rms_norm(x))                             # f32 [B, T, vocab]

``head`` is ``h @ embed.table^T`` when ``tie_embeddings`` else its own ``[d_model, vocab]``
kernel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.model.attention import (
    Attention,
    AttentionImpl,
    cache_mask,
    causal_mask,
    rope_tables,
    segment_mask,
)
from jaxlab.model.cache import KVCache
from jaxlab.model.layers import (
    INIT_STD,
    MLP,
    Embedding,
    RMSNorm,
    dense,
    dropout,
    normal_init,
)

Array = jax.Array
LayerCache = tuple[Array, Array]


class Block(nnx.Module):
    """One pre-norm residual block: attention then MLP, dropout on each branch output."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        impl: AttentionImpl,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> None:
        self.dropout_rate = float(cfg.dropout_rate)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.attn = Attention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            n_layers=cfg.n_layers,
            impl=impl,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(
            cfg.d_model,
            cfg.d_mlp,
            cfg.mlp,
            n_layers=cfg.n_layers,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )

    def __call__(
        self,
        x: Array,
        mask: Array,
        rope: tuple[Array, Array] | None,
        cache: LayerCache | None,
        cache_index: Array | None,
        key: Array | None,
        causal: bool = False,
    ) -> tuple[Array, LayerCache | None]:
        """``causal``: ``mask`` is causal (see :func:`jaxlab.model.attention.attend`)."""
        attn_key = mlp_key = None
        if key is not None:
            attn_key, mlp_key = jax.random.split(key)
        a, cache = self.attn(self.attn_norm(x), mask, rope, cache, cache_index, causal=causal)
        x = x + dropout(a, self.dropout_rate, attn_key)
        m = self.mlp(self.mlp_norm(x))
        x = x + dropout(m, self.dropout_rate, mlp_key)
        return x, cache


def _run_block_remat(
    graphdef: nnx.GraphDef[Block],
    state: nnx.State,
    x: Array,
    mask: Array,
    rope: tuple[Array, Array] | None,
    cache: LayerCache | None,
    cache_index: Array | None,
    key: Array | None,
    causal: bool,
) -> tuple[Array, LayerCache | None]:
    """A block as a pure function of its parameters, so ``jax.checkpoint`` can wrap it."""
    return nnx.merge(graphdef, state)(x, mask, rope, cache, cache_index, key, causal)


_run_block_remat_ckpt = jax.checkpoint(_run_block_remat, static_argnums=(0, 8))


class Transformer(nnx.Module):
    """Decoder-only Transformer language model (see module docstring and ``docs/model.md``).

    Args:
      cfg: model shape and variant.
      precision: ``param_dtype`` (storage) and ``compute_dtype`` (matmul inputs).
      rngs: parameter initialisation keys (``rngs.params()`` is drawn per tensor).
      remat: recompute each block's activations in the backward pass
        (``jax.checkpoint`` per block) to trade FLOPs for memory. Can also be toggled later
        via the ``remat`` attribute (before ``nnx.split``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        precision: PrecisionConfig,
        *,
        rngs: nnx.Rngs,
        remat: bool = False,
    ) -> None:
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} must be divisible by n_heads={cfg.n_heads}")
        if cfg.positions == "rope" and cfg.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim (got {cfg.head_dim})")
        param_dtype = jnp.dtype(precision.param_dtype)
        compute_dtype = jnp.dtype(precision.compute_dtype)
        # Plain hashable attributes (not the pydantic config) so the graphdef stays hashable.
        self.positions_kind = cfg.positions
        self.head_dim = cfg.head_dim
        self.rope_theta = float(cfg.rope_theta)
        self.tie_embeddings = cfg.tie_embeddings
        self.param_dtype = param_dtype
        self.compute_dtype = compute_dtype
        self.remat = remat

        self.embed = Embedding(cfg.vocab_size, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
        self.pos_embed = (
            Embedding(cfg.max_seq_len, cfg.d_model, param_dtype=param_dtype, rngs=rngs)
            if cfg.positions == "learned"
            else None
        )
        self.blocks = nnx.List(
            [
                Block(
                    cfg,
                    impl=cfg.attention_impl,
                    param_dtype=param_dtype,
                    compute_dtype=compute_dtype,
                    rngs=rngs,
                )
                for _ in range(cfg.n_layers)
            ]
        )
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else nnx.Param(
                normal_init(rngs.params(), (cfg.d_model, cfg.vocab_size), INIT_STD, param_dtype)
            )
        )

    def __call__(
        self,
        tokens: Array,
        positions: Array,
        *,
        segment_ids: Array | None = None,
        kv_cache: KVCache | None = None,
        cache_index: Array | None = None,
        dropout_key: Array | None = None,
    ) -> tuple[Array, KVCache | None]:
        """Logits for every input token, and the updated cache when one is given.

        Args:
          tokens: ``int32[B, T]``.
          positions: ``int32[B, T]``, given by the caller (restarting per packed document;
            for cached calls position ``p`` must be the token's cache slot).
          segment_ids: ``int32[B, T]`` document ids for packed rows (no cache only): a token
            attends to earlier-or-same tokens of its own segment.
          kv_cache: per-layer K/V buffers ``[B, S, K, D]``. When given, the ``T`` new
            tokens' K/V are written at slots ``cache_index[b] .. cache_index[b] + T - 1``
            and queries attend to cache slots ``s <= positions[b, t]``.
          cache_index: ``int32[B]`` write start per row; required with ``kv_cache``.
          dropout_key: PRNG key enabling dropout (rate ``cfg.dropout_rate``); None = off.

        Returns:
          ``(logits f32[B, T, vocab], new KVCache or None)``.
        """
        h, new_cache = self.features(
            tokens,
            positions,
            segment_ids=segment_ids,
            kv_cache=kv_cache,
            cache_index=cache_index,
            dropout_key=dropout_key,
        )
        return self.logits(h), new_cache

    def logits(self, h: Array) -> Array:
        """The LM head on final-normed features ``[..., d_model]`` -> f32 ``[..., vocab]``."""
        if self.lm_head is None:
            return self.embed.attend(h, self.compute_dtype)
        return dense(h, self.lm_head[...], self.compute_dtype, jnp.float32)

    def embed_inputs(
        self, tokens: Array, positions: Array
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """The first block's input ``x`` (token + learned position embeddings) and the RoPE
        ``(sin, cos)`` tables for ``positions`` (None without RoPE), shared by every layer."""
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        # sin/cos depend only on positions: compute once, share across layers.
        rope = (
            rope_tables(positions, self.head_dim, self.rope_theta)
            if self.positions_kind == "rope"
            else None
        )
        return x, rope

    def head_kernel(self) -> tuple[Array, bool]:
        """``(kernel, vocab_major)`` of the LM head: the ``[V, d]`` embedding table when
        tied (``vocab_major=True``), else the ``[d, V]`` ``lm_head``. Logits are
        ``features @ kernel^T`` resp. ``features @ kernel`` (see :meth:`features`)."""
        if self.lm_head is None:
            return self.embed.table[...], True
        return self.lm_head[...], False

    def features(
        self,
        tokens: Array,
        positions: Array,
        *,
        segment_ids: Array | None = None,
        kv_cache: KVCache | None = None,
        cache_index: Array | None = None,
        dropout_key: Array | None = None,
    ) -> tuple[Array, KVCache | None]:
        """The LM head's input: final-normed hidden states ``f32[B, T, d_model]``.

        Same arguments as :meth:`__call__`, which is ``features`` followed by the head.
        The training loss uses this with :func:`jaxlab.model.loss.head_cross_entropy`,
        so the ``[B, T, vocab]`` logits are never materialised.
        """
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens and positions must both be [B, T] (got {tokens.shape} and "
                f"{positions.shape})"
            )
        t = tokens.shape[1]
        x, rope = self.embed_inputs(tokens, positions)

        if kv_cache is None:
            if cache_index is not None:
                raise ValueError("cache_index given without a kv_cache")
            mask = causal_mask(t)
            if segment_ids is not None:
                mask = mask & segment_mask(segment_ids)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids are not supported together with a kv_cache")
            if cache_index is None:
                raise ValueError("cache_index (int32[B]) is required with a kv_cache")
            if kv_cache.n_layers != len(self.blocks):
                raise ValueError(
                    f"kv_cache has {kv_cache.n_layers} layers, model has {len(self.blocks)}"
                )
            mask = cache_mask(positions, kv_cache.max_len)

        # Without a cache the mask is causal (& same-segment): every token sees itself, none
        # sees its future, so attention may skip key blocks in a query block's future.
        causal = kv_cache is None
        new_k: list[Array] = []
        new_v: list[Array] = []
        for i, block in enumerate(self.blocks):
            layer_cache = None if kv_cache is None else (kv_cache.k[i], kv_cache.v[i])
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            if self.remat:
                graphdef, state = nnx.split(block)
                x, layer_cache = _run_block_remat_ckpt(
                    graphdef, state, x, mask, rope, layer_cache, cache_index, key, causal
                )
            else:
                x, layer_cache = block(x, mask, rope, layer_cache, cache_index, key, causal)
            if layer_cache is not None:
                new_k.append(layer_cache[0])
                new_v.append(layer_cache[1])

        h = self.final_norm(x)
        new_cache = None if kv_cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
        return h, new_cache


def make_model(
    cfg: ModelConfig, precision: PrecisionConfig, seed: int, *, remat: bool = False
) -> Transformer:
    """Build a :class:`Transformer` with parameters initialised from ``seed``."""
    return Transformer(cfg, precision, rngs=nnx.Rngs(params=seed), remat=remat)


def split_model(model: Transformer) -> tuple[nnx.GraphDef[Transformer], nnx.State]:
    """``(graphdef, params)``: the static structure and the ``nnx.Param`` state (all of it).

    The model holds no state other than parameters, so ``params`` is complete and
    ``nnx.merge(graphdef, params)`` rebuilds an equivalent module.
    """
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, params


def apply(
    graphdef: nnx.GraphDef[Transformer],
    params: nnx.State,
    tokens: Array,
    positions: Array,
    **kwargs: Any,
) -> tuple[Array, KVCache | None]:
    """Pure functional forward: ``merge(graphdef, params)(tokens, positions, **kwargs)``.

    ``kwargs`` are the keyword arguments of :meth:`Transformer.__call__`
    (``segment_ids``, ``kv_cache``, ``cache_index``, ``dropout_key``). ``graphdef`` is
    static: close over it (or mark it static) when jitting.
    """
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, **kwargs)
