"""Attention: masks, rotary positions, the one ``attend`` function, cache writes, the layer.

Shapes (letters used throughout)::

    B batch   T query length   S key/value length   H query heads   K key/value heads
    G = H // K query heads per key/value head        D head_dim

Masks are boolean, ``True`` = may attend, shaped ``[B | 1, 1, T, S]`` (the head axis is 1:
every head shares a mask) and combined with ``&``. Both :func:`attend` implementations take
the same mask, so every code path (training, packed documents, prefill, decode) goes through
one function.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from jaxlab.model.layers import INIT_STD, dense, normal_init, residual_std
from jaxlab.model.reduce import softmax_last

Array = jax.Array
AttentionImpl = Literal["einsum", "xla"]

#: Added in place of masked logits: large and negative but finite, so a fully masked row
#: (e.g. a padding query) gives a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


# ----------------------------------------------------------------------------------- masks


def causal_mask(length: int) -> Array:
    """``bool[1, 1, T, T]``: query ``t`` sees keys ``s <= t`` (by index in the sequence)."""
    idx = jnp.arange(length)
    return (idx[None, :] <= idx[:, None])[None, None]


def segment_mask(q_segment_ids: Array, kv_segment_ids: Array | None = None) -> Array:
    """``bool[B, 1, T, S]``: query and key belong to the same segment (packed document).

    ``kv_segment_ids`` defaults to ``q_segment_ids`` (self-attention).
    """
    kv = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    return (q_segment_ids[:, :, None] == kv[:, None, :])[:, None]


def padding_mask(lengths: Array, kv_len: int) -> Array:
    """``bool[B, 1, 1, S]``: key slot ``s`` is valid iff ``s < lengths[b]``."""
    return (jnp.arange(kv_len)[None, :] < lengths[:, None])[:, None, None, :]


def cache_mask(positions: Array, kv_len: int) -> Array:
    """``bool[B, 1, T, S]``: cache slot ``s`` is visible to a query iff ``s <= positions[b, t]``.

    This is the single mask used with a KV cache. It relies on the invariant that the token
    at position ``p`` lives in cache slot ``p``; then it is causal for prefill and decode,
    and slots beyond a row's length (stale or padding entries) are invisible because they
    lie in that row's future.
    """
    slots = jnp.arange(kv_len)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


# ------------------------------------------------------------------------------------ RoPE


def rope_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """``(sin, cos)``, each ``f32[B, T, 1, D/2]``, for rotary embeddings at ``positions``.

    Computed once per forward pass and shared by every layer (it depends only on positions).
    Frequencies follow RoFormer: ``theta^(-2i/D)`` for ``i < D/2``.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]


def apply_rope(x: Array, sin: Array, cos: Array) -> Array:
    """Rotate ``x: [B, T, N, D]`` by the angles in ``sin``/``cos``; computed in f32.

    Uses the "half-split" pairing (channel ``i`` with ``i + D/2``, as in GPT-NeoX/LLaMA)
    rather than interleaved pairs: contiguous halves avoid strided gathers. The result is
    cast back to ``x.dtype``.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------- attend


def attend(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    impl: AttentionImpl,
    *,
    causal: bool = False,
) -> Array:
    """Scaled dot-product attention with grouped KV heads.

    Args:
      q: ``[B, T, H, D]`` queries.
      k, v: ``[B, S, K, D]`` keys/values, ``H % K == 0`` (K = 1 is MQA, K = H is MHA).
        They are cast to ``q.dtype`` (a no-op unless the cache is stored narrower/wider).
      mask: boolean, broadcastable to ``[B, 1, T, S]``; ``True`` = attend. None = no mask.
      impl: ``"einsum"`` (explicit grouped einsum below) or ``"xla"``
        (``jax.nn.dot_product_attention(..., implementation="xla")``, which groups the
        heads the same way internally).
      causal: the caller guarantees that ``mask`` hides every key after its query
        (``mask[..., t, s]`` is False for ``s > t``, with ``T == S``) and that every query
        sees at least one key (e.g. itself) - true of ``causal_mask`` combined with
        ``segment_mask``. The first half of the queries then skips the second half of the
        keys, which it cannot see anyway: a quarter of the work, the same result up to f32
        summation order.

    Scale is ``1/sqrt(D)``. Logits and softmax are float32 in both implementations; the
    probabilities are cast to the value dtype for the second matmul. Returns
    ``[B, T, H, D]`` in ``q.dtype``.
    """
    t = q.shape[1]
    if causal and mask is not None and k.shape[1] == t and t % 2 == 0 and t >= 64:
        # Two query blocks: [0, T/2) against keys [0, T/2), [T/2, T) against all keys.
        # Measured 1.07x on the bench-small train step (docs/performance.md); four blocks
        # were no faster. The skipped keys are masked for those queries, and a masked
        # key's softmax weight is exactly 0 in f32 (the row max is a visible key's logit,
        # so exp(MASK_VALUE - max) underflows to 0): only the summation order changes.
        half = t // 2
        m = jnp.broadcast_to(mask, (*mask.shape[:2], t, t))
        lo = attend(q[:, :half], k[:, :half], v[:, :half], m[:, :, :half, :half], impl)
        hi = attend(q[:, half:], k, v, m[:, :, half:, :], impl)
        return jnp.concatenate([lo, hi], axis=1)
    k = k.astype(q.dtype)
    v = v.astype(q.dtype)
    if impl == "xla":
        if mask is not None:
            mask = jnp.asarray(mask, dtype=jnp.bool_)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    if impl != "einsum":
        raise ValueError(f"unknown attention impl {impl!r}; expected 'einsum' or 'xla'")

    b, t, h, d = q.shape
    s, n_kv = k.shape[1], k.shape[2]
    g = h // n_kv
    # Head-major layout: the grouped queries become one [G*T] row axis per KV head, so both
    # matmuls are plain batched [B, K] matmuls over contiguous [rows, D] / [S, D] slabs.
    # Group the query heads by their KV head instead of repeating K/V G times: each group
    # is contracted against the one shared KV head, so no [B, S, H, D] copy exists. On
    # XLA:CPU this layout also needs fewer transposes in the backward pass than
    # contracting the [B, T, K, G, D] layout directly (docs/performance.md).
    qh = q.reshape(b, t, n_kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, n_kv, g * t, d)
    kh = k.transpose(0, 2, 1, 3)  # [B, K, S, D]
    vh = v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("bkqd,bksd->bkqs", qh, kh, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    if mask is not None:
        # [B|1, 1, T, S] -> [B|1, 1, 1, T, S]: broadcasts over (K, G) of [B, K, G, T, S].
        logits = logits.reshape(b, n_kv, g, t, s)
        logits = jnp.where(mask[:, :, None], logits, MASK_VALUE).reshape(b, n_kv, g * t, s)
    probs = softmax_last(logits).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vh)
    return out.reshape(b, n_kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


# ----------------------------------------------------------------------------- cache write


def write_cache(cache: Array, new: Array, start: Array) -> Array:
    """Write ``new: [B, T, K, D]`` into ``cache: [B, S, K, D]`` at per-row slot ``start[b]``.

    Functional (returns the updated array); under ``jit`` with the cache donated XLA performs
    it in place. The caller must keep ``start[b] + T <= S``: ``dynamic_update_slice`` clamps
    an out-of-range start (it would shift the write, not fail).
    """

    if new.shape[1] == cache.shape[1]:
        # The write covers every slot, so the (clamped) start can only be 0: the result is
        # ``new``. Prefill hits this: scattering into a zero-filled cache of the bucket's
        # length made XLA:CPU materialise a zero buffer per layer (~1 ms each at 16 rows).
        return new.astype(cache.dtype)

    def row(c: Array, n: Array, i: Array) -> Array:
        return jax.lax.dynamic_update_slice(c, n, (i, 0, 0))

    return jax.vmap(row)(cache, new.astype(cache.dtype), start.astype(jnp.int32))


# ----------------------------------------------------------------------------------- layer


class Attention(nnx.Module):
    """Multi-head self-attention with grouped-query KV heads and a fused QKV projection.

    Parameters (no biases):

    * ``w_qkv``: ``[d_model, (H + 2K) * D]`` - one matmul produces Q, K and V; columns are
      ``[q heads | k heads | v heads]``, each head ``D`` wide.
    * ``w_out``: ``[H * D, d_model]`` - residual output projection (scaled init).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        n_layers: int,
        impl: AttentionImpl,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> None:
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.impl: AttentionImpl = impl
        self.compute_dtype = compute_dtype
        width = (n_heads + 2 * n_kv_heads) * self.head_dim
        self.w_qkv = nnx.Param(normal_init(rngs.params(), (d_model, width), INIT_STD, param_dtype))
        self.w_out = nnx.Param(
            normal_init(
                rngs.params(),
                (n_heads * self.head_dim, d_model),
                residual_std(n_layers),
                param_dtype,
            )
        )

    def __call__(
        self,
        x: Array,
        mask: Array,
        rope: tuple[Array, Array] | None,
        cache: tuple[Array, Array] | None = None,
        cache_index: Array | None = None,
        *,
        causal: bool = False,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """``x: [B, T, d_model]`` -> (f32 ``[B, T, d_model]``, updated ``(k, v)`` cache or None).

        With ``cache = (k, v)`` (each ``[B, S, K, D]``) the new keys/values are written at
        ``cache_index`` first and the queries then attend over all ``S`` slots (``mask`` must
        then be ``[B, 1, T, S]``, see :func:`cache_mask`). ``causal``: see :func:`attend`
        (ignored with a cache).
        """
        b, t, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = dense(x, self.w_qkv[...], self.compute_dtype).reshape(b, t, h + 2 * kv, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
        if rope is not None:
            sin, cos = rope
            q = apply_rope(q, sin, cos)
            k = apply_rope(k, sin, cos)  # keys are cached already rotated
        new_cache: tuple[Array, Array] | None = None
        if cache is not None:
            if cache_index is None:
                raise ValueError("cache_index is required with a KV cache")
            k = write_cache(cache[0], k, cache_index)
            v = write_cache(cache[1], v, cache_index)
            new_cache = (k, v)
        out = attend(q, k, v, mask, self.impl, causal=causal and cache is None)
        out = dense(out.reshape(b, t, h * d), self.w_out[...], self.compute_dtype, jnp.float32)
        return out, new_cache
