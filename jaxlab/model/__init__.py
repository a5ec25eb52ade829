"""jaxlab.model: a decoder-only Transformer LM written from first principles in Flax NNX.

Stateful use (tests, notebooks)::

    model = make_model(cfg.model, cfg.train.precision, seed=0)
    logits = model(tokens, positions)                        # f32 [B, T, vocab]
    h, cache = model.prefill(tokens, positions, max_len=64)  # + every layer's K/V as a cache
    h, cache = model.decode(next_tokens, pos, cache)         # one token per row
    pages = model.init_pages(rows=2, num_pages=8, page_size=16, max_len=64)  # NO_PAGE table
    pages = dataclasses.replace(pages, table=table)          # each row's pages (host-chosen)
    h, pages = model.prefill_pages(tokens, positions, pages) # K/V into those pages
    h, pages = model.decode(next_tokens, pos, pages)         # reads them through the table
    logits = model.logits(h)

Pure functional use (trainers, the inference engine): split once, jit a function of arrays::

    graphdef, params = split_model(model)          # == nnx.split(model, nnx.Param)

    @jax.jit
    def loss_fn(params, tokens, positions, targets, key):
        logits = apply(graphdef, params, tokens, positions, dropout_key=key)
        ...

``graphdef`` is static (closed over above); ``params`` is an ``nnx.State`` pytree holding
every parameter (the model has no other state), so ``jax.grad`` / optax work on it directly
and ``nnx.merge(graphdef, params)`` rebuilds the module. The attention math and the decode
cache's layout belong to a kernel (:mod:`jaxlab.kernels`, ``model.attention_impl``).

See ``docs/model.md`` for the architecture, precision policy, cache layout and masks.
"""

from jaxlab.model.attention import Attention, apply_rope, rope_tables
from jaxlab.model.flops import (
    flops_per_token,
    lora_flops_per_token,
    matmul_param_count,
    param_count,
)
from jaxlab.model.layers import MLP, Embedding, RMSNorm, dense, dropout
from jaxlab.model.transformer import (
    AnyCache,
    Block,
    Cache,
    Transformer,
    apply,
    make_model,
    split_model,
)

__all__ = [
    "MLP",
    "AnyCache",
    "Attention",
    "Block",
    "Cache",
    "Embedding",
    "RMSNorm",
    "Transformer",
    "apply",
    "apply_rope",
    "dense",
    "dropout",
    "flops_per_token",
    "lora_flops_per_token",
    "make_model",
    "matmul_param_count",
    "param_count",
    "rope_tables",
    "split_model",
]
