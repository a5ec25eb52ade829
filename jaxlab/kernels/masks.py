"""Who may attend to whom: the boolean masks every attention kernel agrees on.

Masks are ``True`` = may attend, shaped ``[B | 1, 1, T, S]`` (the head axis is 1: every
head shares a mask) and combined with ``&``. They are the specification of visibility: the
reference kernel applies them literally, and a faster kernel must attend to exactly the same
keys (tests check it against the reference).

The one invariant shared by every cache layout: the token at position ``p`` of a row lives
in cache slot ``p``, and a query at position ``p`` sees slots ``<= p``. Slots past a row's
length (stale or padding entries) are then invisible because they lie in its future.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

#: Added in place of masked logits: large and negative but finite, so a fully masked row
#: (e.g. a padding query) gives a uniform softmax instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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

    The single mask used with a KV cache: causal for prefill and decode alike, given the
    slot-equals-position invariant (module docstring).
    """
    slots = jnp.arange(kv_len)
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


def self_attention_mask(length: int, segment_ids: Array | None) -> Array:
    """Causal, and within a segment when ``segment_ids [B, T]`` are given (packed rows)."""
    mask = causal_mask(length)
    return mask if segment_ids is None else mask & segment_mask(segment_ids)


__all__ = [
    "MASK_VALUE",
    "cache_mask",
    "causal_mask",
    "padding_mask",
    "segment_mask",
    "self_attention_mask",
]
