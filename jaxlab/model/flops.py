"""Analytic parameter and FLOP counts, from the config alone (no model is built).

Parameter count (no biases), with ``D = d_model // n_heads`` and ``d = d_model``::

    embedding        V * d
    positions        max_seq_len * d                     (learned positions only)
    per layer        2 * d                               (two RMSNorm gains)
                   + d * (H + 2K) * D                    (fused Q/K/V projection)
                   + H * D * d                           (attention output)
                   + 3 * d * d_mlp  (swiglu) | 2 * d * d_mlp  (gelu)
    final norm       d
    LM head          d * V                               (untied only)

FLOPs per token (PaLM appendix B convention; a multiply-add counts 2)::

    forward  = 2 * N + 4 * n_layers * d_model * seq_len
    training = 6 * N + 12 * n_layers * d_model * seq_len   (= 3 x forward)

``N`` is the parameter count **minus the lookup tables**: the input token embedding when
untied, and the learned position table (lookups are gathers, not matmuls). The LM head is
always included; when tied, the shared table is counted once (as the head). The RMSNorm
gains stay in ``N`` (negligible: ``(2 L + 1) d``). The attention
term counts the score (``QK^T``) and value (``PV``) matmuls over the full ``seq_len``
context, i.e. non-causal (no halving for the causal mask), as in PaLM.
"""

from __future__ import annotations

from jaxlab.config.schema import ModelConfig


def _per_layer_params(cfg: ModelConfig) -> int:
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    norms = 2 * d
    qkv = d * (h + 2 * kv) * hd
    out = h * hd * d
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_mlp
    return norms + qkv + out + mlp


def param_count(cfg: ModelConfig) -> int:
    """Exact number of scalar parameters of ``Transformer(cfg, ...)`` (see module docs)."""
    d, v = cfg.d_model, cfg.vocab_size
    total = v * d  # token embedding
    if cfg.positions == "learned":
        total += cfg.max_seq_len * d
    total += cfg.n_layers * _per_layer_params(cfg)
    total += d  # final norm
    if not cfg.tie_embeddings:
        total += d * v  # LM head
    return total


def matmul_param_count(cfg: ModelConfig) -> int:
    """``N`` of the FLOP formula: :func:`param_count` minus lookup-only tables.

    Subtracts the token embedding when untied (when tied it is the LM head's kernel and
    stays) and the learned position table.
    """
    n = param_count(cfg)
    if not cfg.tie_embeddings:
        n -= cfg.vocab_size * cfg.d_model
    if cfg.positions == "learned":
        n -= cfg.max_seq_len * cfg.d_model
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """Model FLOPs per token at context ``seq_len``.

    ``training``: ``6 * N + 12 * n_layers * d_model * seq_len``;
    otherwise (forward only): ``2 * N + 4 * n_layers * d_model * seq_len``;
    with ``N = matmul_param_count(cfg)`` = parameters excluding the input token embedding
    (when untied) and the learned position table, including the LM head (and the norm
    gains). Attention matmuls are counted non-causally (PaLM appendix B).
    """
    n = matmul_param_count(cfg)
    attn = cfg.n_layers * cfg.d_model * seq_len
    if training:
        return float(6 * n + 12 * attn)
    return float(2 * n + 4 * attn)


def lora_flops_per_token(cfg: ModelConfig, seq_len: int, adapter_params: int) -> float:
    """Training FLOPs per token with the base frozen and LoRA adapters of ``adapter_params``
    values: ``4 * N + 6 * adapter_params + 12 * n_layers * d_model * seq_len``.

    The base runs forward (``2 N``) and passes gradients back through its activations
    (``2 N``), but computes no gradients for its own weights (the ``2 N`` a full step adds);
    the adapters are trained in full (``6`` FLOPs per value, as in :func:`flops_per_token`);
    the attention matmuls have no weights and run in full either way. A LoRA step that
    reported ``6 N`` would claim work it does not do.
    """
    n = matmul_param_count(cfg)
    return float(4 * n + 6 * adapter_params + 12 * cfg.n_layers * cfg.d_model * seq_len)
