"""jaxlab.model: a decoder-only Transformer LM written from first principles in Flax NNX.

Stateful use (tests, notebooks)::

    model = make_model(cfg.model, cfg.train.precision, seed=0)
    logits, _ = model(tokens, positions)                      # f32 [B, T, vocab]

Pure functional use (trainers, the inference engine) - split once, jit a function of arrays::

    graphdef, params = split_model(model)          # == nnx.split(model, nnx.Param)

    @jax.jit
    def loss_fn(params, tokens, positions, targets, key):
        logits, _ = apply(graphdef, params, tokens, positions, dropout_key=key)
        ...

    # decode step, cache donated so the K/V write is in place:
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens, positions):
        logits, cache = apply(graphdef, params, tokens, positions,
                              kv_cache=cache, cache_index=positions[:, 0])
        return logits, cache

``graphdef`` is static (closed over above); ``params`` is an ``nnx.State`` pytree holding
every parameter (the model has no other state), so ``jax.grad`` / optax work on it
directly and ``nnx.merge(graphdef, params)`` rebuilds the module.

See ``docs/model.md`` for the architecture, precision policy, cache layout and masks.
"""

from jaxlab.model.attention import (
    MASK_VALUE,
    Attention,
    AttentionImpl,
    apply_rope,
    attend,
    cache_mask,
    causal_mask,
    padding_mask,
    rope_tables,
    segment_mask,
    write_cache,
)
from jaxlab.model.cache import KVCache, init_kv_cache
from jaxlab.model.flops import flops_per_token, matmul_param_count, param_count
from jaxlab.model.layers import MLP, Embedding, RMSNorm, dense, dropout
from jaxlab.model.transformer import Block, Transformer, apply, make_model, split_model

__all__ = [
    "MASK_VALUE",
    "MLP",
    "Attention",
    "AttentionImpl",
    "Block",
    "Embedding",
    "KVCache",
    "RMSNorm",
    "Transformer",
    "apply",
    "apply_rope",
    "attend",
    "cache_mask",
    "causal_mask",
    "dense",
    "dropout",
    "flops_per_token",
    "init_kv_cache",
    "make_model",
    "matmul_param_count",
    "padding_mask",
    "param_count",
    "rope_tables",
    "segment_mask",
    "split_model",
    "write_cache",
]
