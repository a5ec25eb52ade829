"""Analytic parameter and FLOP counts."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.model import (
    Transformer,
    flops_per_token,
    lora_flops_per_token,
    matmul_param_count,
    param_count,
)


def real_param_count(cfg: ModelConfig) -> int:
    # eval_shape: build the module abstractly (no init compute), count nnx.Param leaves.
    model = nnx.eval_shape(lambda: Transformer(cfg, PrecisionConfig(), rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))


CASES: list[dict[str, Any]] = [
    {},
    {"tie_embeddings": True},
    {"positions": "learned"},
    {"positions": "learned", "tie_embeddings": True, "mlp": "gelu"},
    {"mlp": "gelu", "n_kv_heads": 1},
    {"n_kv_heads": 2, "n_layers": 3},
    {"n_heads": 8, "n_kv_heads": 4, "d_model": 64, "d_mlp": 100, "vocab_size": 7},
]


@pytest.mark.parametrize("overrides", CASES, ids=[str(c) for c in CASES])
def test_param_count_matches_module(overrides: dict[str, Any]) -> None:
    base: dict[str, Any] = dict(
        vocab_size=50, n_layers=2, d_model=32, n_heads=4, n_kv_heads=4, d_mlp=40, max_seq_len=24
    )
    cfg = ModelConfig(**{**base, **overrides})
    assert param_count(cfg) == real_param_count(cfg)


def test_param_and_flop_counts_hand_worked() -> None:
    # vocab 100, L=2, d=16, H=4, K=2 (head_dim 4), d_mlp=32, swiglu, rope, untied.
    cfg = ModelConfig(
        vocab_size=100, n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, d_mlp=32, max_seq_len=64
    )
    # per layer: norms 2*16 + qkv 16*(4+2*2)*4 + out 16*16 + mlp 3*16*32 = 32+512+256+1536
    per_layer = 2336
    total = 100 * 16 + 2 * per_layer + 16 + 16 * 100  # embed + layers + final norm + head
    assert param_count(cfg) == total == 7888
    n = total - 100 * 16  # untied: the input embedding is a lookup, not a matmul
    assert matmul_param_count(cfg) == n == 6288
    # training: 6 N + 12 L d T ; forward: 2 N + 4 L d T   (T = 10)
    assert flops_per_token(cfg, 10) == 6 * 6288 + 12 * 2 * 16 * 10 == 41568
    assert flops_per_token(cfg, 10, training=False) == 2 * 6288 + 4 * 2 * 16 * 10 == 13856
    # LoRA, 100 adapter values: the base's forward and activation gradients, no weight
    # gradients; the adapters' full 6 per value; attention in full.
    assert lora_flops_per_token(cfg, 10, 100) == 4 * 6288 + 6 * 100 + 12 * 2 * 16 * 10 == 29592


def test_flop_count_tied_learned() -> None:
    # vocab 100, L=1, d=8, H=2, K=1 (head_dim 4), d_mlp=16, gelu, learned, tied, S_max=20.
    cfg = ModelConfig(
        vocab_size=100,
        n_layers=1,
        d_model=8,
        n_heads=2,
        n_kv_heads=1,
        d_mlp=16,
        max_seq_len=20,
        mlp="gelu",
        positions="learned",
        tie_embeddings=True,
    )
    # layer: 2*8 + 8*(2+2)*4 + 8*8 + 2*8*16 = 16+128+64+256 = 464
    assert param_count(cfg) == 100 * 8 + 20 * 8 + 464 + 8 == 1432
    # Tied: the table is the LM head and stays in N; the position table is a lookup.
    assert matmul_param_count(cfg) == 1432 - 20 * 8 == 1272
    assert flops_per_token(cfg, 20) == 6 * 1272 + 12 * 1 * 8 * 20 == 9552
    assert flops_per_token(cfg, 20, training=False) * 3 == flops_per_token(cfg, 20)
