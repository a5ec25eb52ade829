"""LM head + softmax cross-entropy, fused and chunked over tokens (never ``[N, V]`` logits).

The plain way - ``logits = h @ W^T`` then ``logsumexp(logits) - logits[target]`` and let
autodiff do the rest - materialises the f32 ``[N, V]`` logits, then their gradient, and
reads each of them several times (max, exp-sum, gather, argmax, softmax - onehot, two
matmuls). At ``N = 4096`` tokens and ``V = 8192`` that is 134 MB per pass, and on a
memory-bound CPU those passes cost more than the head's matmuls themselves
(``docs/performance.md``).

:func:`head_cross_entropy` computes the same sums chunk by chunk: each ``[C, V]`` logits
block is produced, reduced and turned into its gradient while it is still in cache.
Under differentiation the forward pass also computes the gradients with respect to ``h``
and the head kernel (the loss is a sum, so ``d loss / d logits = mask * (softmax -
onehot)`` is known in the forward pass), and the backward pass only scales them by the
incoming cotangent - so the logits are computed once, not recomputed. Without
differentiation (evaluation) only the forward sums run.

Semantics equal the plain computation up to f32 summation order: the same
``logsumexp - logit[target]`` per token, the same token-weighted sum, and ``correct``
counts ``argmax(logits) == target`` with ``argmax``'s first-index tie-breaking.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxlab.kernels.reduce import first_index_of, reduce_last

Array = jax.Array

#: Tokens per chunk (about: a chunk is ``chunk // B`` positions of every row). A ``[C, V]``
#: f32 block at V = 8192 is 8 MiB for C = 256, so it stays in a 32 MiB L3 while it is
#: reduced and turned into its gradient; 256 was the fastest of 128 / 256 / 512 for the
#: bench-small train step (``docs/performance.md``).
DEFAULT_CHUNK = 256


def _chunk_stats(logits: Array, targets: Array) -> tuple[Array, Array, Array, Array]:
    """Per-row ``(max, sum(exp(logits - max)), logit[target], argmax == target)``."""
    # Reductions over the vocabulary go through ``reduce_last``: in two stages where the
    # platform wants them (XLA:CPU), since these passes are the head's largest cost after
    # its dots there.
    m = reduce_last(logits, "max")
    s = reduce_last(jnp.exp(logits - m[:, None]), "sum")
    tl = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    # argmax (first-index tie-break) from the max already taken: XLA:CPU's variadic
    # ``jnp.argmax`` reduce slows the whole head down (docs/performance.md).
    return m, s, tl, first_index_of(logits, m) == targets


def _forward(h, w, targets, mask, vocab_major, compute_dtype, seq_chunk, with_grads):
    """Scan over sequence chunks of ``h: [B, T, d]`` (``T`` a multiple of ``seq_chunk``).

    Chunking along the sequence, not the flattened tokens, keeps the batch axis whole, so
    a batch-sharded ``h`` stays sharded the same way inside the loop.
    """
    b, t, d = h.shape
    n_chunks = t // seq_chunk
    wc = w.astype(compute_dtype)
    # Both orientations of the kernel, made once per call (an 8 MiB copy at V = 8192):
    # ``[C, d] @ [d, V]`` for the logits and ``[C, V] @ [V, d]`` for ``dh`` are the
    # forms XLA:CPU runs fastest; the kernel gradient is accumulated as ``[d, V]``.
    w_dv = wc.T if vocab_major else wc
    w_vd = wc if vocab_major else wc.T  # unused (and dropped by XLA) without grads

    def body(i, carry):
        start = i * seq_chunk
        hc = jax.lax.dynamic_slice_in_dim(h, start, seq_chunk, axis=1)
        tc = jax.lax.dynamic_slice_in_dim(targets, start, seq_chunk, axis=1).reshape(-1)
        mc = jax.lax.dynamic_slice_in_dim(mask, start, seq_chunk, axis=1).reshape(-1)
        hc = hc.reshape(b * seq_chunk, d).astype(compute_dtype)
        logits = jnp.matmul(hc, w_dv, preferred_element_type=jnp.float32)
        mx, s, tl, hit = _chunk_stats(logits, tc)
        ce = mx + jnp.log(s) - tl
        out = dict(carry)
        out["loss"] = carry["loss"] + jnp.sum(ce * mc)
        out["correct"] = carry["correct"] + jnp.sum(hit.astype(jnp.float32) * mc)
        out["ce"] = jax.lax.dynamic_update_slice_in_dim(
            carry["ce"], ce.reshape(b, seq_chunk), start, axis=1
        )
        if with_grads:
            # d(sum_i mask_i ce_i) / d logits = mask * (softmax - onehot(target)).
            scale = mc / s
            p = jnp.exp(logits - mx[:, None]) * scale[:, None]
            iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
            dl = jnp.where(iota == tc[:, None], p - mc[:, None], p).astype(compute_dtype)
            dh = jnp.matmul(dl, w_vd, preferred_element_type=jnp.float32)
            out["dh"] = jax.lax.dynamic_update_slice_in_dim(
                carry["dh"], dh.reshape(b, seq_chunk, d).astype(h.dtype), start, axis=1
            )
            out["dw"] = carry["dw"] + jnp.matmul(hc.T, dl, preferred_element_type=jnp.float32)
        return out

    init = {
        "loss": jnp.zeros((), jnp.float32),
        "correct": jnp.zeros((), jnp.float32),
        "ce": jnp.zeros((b, t), jnp.float32),
    }
    if with_grads:
        init["dh"] = jnp.zeros(h.shape, h.dtype)
        init["dw"] = jnp.zeros(w_dv.shape, jnp.float32)
    carry = jax.lax.fori_loop(0, n_chunks, body, init)
    grads = None
    if with_grads:
        dw = carry["dw"].T if vocab_major else carry["dw"]
        grads = (carry["dh"], dw)
    return carry["loss"], carry["correct"], carry["ce"], grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _head_ce(h, w, targets, mask, vocab_major, compute_dtype, seq_chunk):
    loss, correct, _, _ = _forward(
        h, w, targets, mask, vocab_major, compute_dtype, seq_chunk, False
    )
    return loss, correct


def _head_ce_fwd(h, w, targets, mask, vocab_major, compute_dtype, seq_chunk):
    loss, correct, ce, grads = _forward(
        h, w, targets, mask, vocab_major, compute_dtype, seq_chunk, True
    )
    assert grads is not None
    dh, dw = grads
    return (loss, correct), (dh, dw.astype(w.dtype), ce, targets)


def _head_ce_bwd(vocab_major, compute_dtype, seq_chunk, res, cts):
    del vocab_major, compute_dtype, seq_chunk
    dh, dw, ce, targets = res
    g_loss = cts[0]  # ``correct`` is a count: it has no gradient
    return (
        (g_loss * dh).astype(dh.dtype),
        (g_loss * dw).astype(dw.dtype),
        # integer targets: float0 cotangent (what JAX expects for integer primals)
        np.zeros(targets.shape, jax.dtypes.float0),
        g_loss * ce,  # d loss / d mask_i = ce_i
    )


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)


def head_cross_entropy(
    h: Array,
    w: Array,
    targets: Array,
    mask: Array,
    *,
    vocab_major: bool,
    compute_dtype: DTypeLike = jnp.float32,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[Array, Array]:
    """``(sum_i mask_i * ce_i, sum_i mask_i * [argmax logits_i == target_i])``, both f32.

    Args:
      h: ``[..., d]`` final hidden states (the LM head's input).
      w: the head kernel: ``[V, d]`` when ``vocab_major`` (a tied embedding table), else
        ``[d, V]``. Logits are ``h @ w^T`` resp. ``h @ w`` with inputs in
        ``compute_dtype`` and an f32 result.
      targets: ``int[...]`` target ids (same leading shape as ``h``).
      mask: ``[...]`` per-token loss weights (0 = padding).
      chunk: tokens per logits block (rows are zero-padded to a multiple; padding has
        mask 0 and contributes nothing).

    Differentiable in ``h``, ``w`` and ``mask``; equal to the plain
    ``logsumexp(logits) - logits[target]`` computation up to f32 summation order.
    """
    d = h.shape[-1]
    lead = h.shape[:-1]
    b, t = (1, lead[0]) if len(lead) == 1 else (math.prod(lead[:-1]), lead[-1])
    h3 = h.reshape(b, t, d)
    t3 = targets.reshape(b, t).astype(jnp.int32)
    m3 = mask.reshape(b, t).astype(jnp.float32)
    # Sequence positions per chunk so that a chunk holds about ``chunk`` tokens; T is
    # zero-padded to a multiple (padding has mask 0 and contributes nothing).
    seq_chunk = max(1, min(t, chunk // b))
    pad = (-t) % seq_chunk
    if pad:
        h3 = jnp.pad(h3, ((0, 0), (0, pad), (0, 0)))
        t3 = jnp.pad(t3, ((0, 0), (0, pad)))
        m3 = jnp.pad(m3, ((0, 0), (0, pad)))
    return _head_ce(h3, w, t3, m3, vocab_major, jnp.dtype(compute_dtype), seq_chunk)
