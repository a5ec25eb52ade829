"""The KV cache: per-layer key/value buffers, nothing else.

Layout: ``KVCache.k`` and ``KVCache.v`` are **tuples over layers** (``len == n_layers``),
each element ``[batch, max_len, n_kv_heads, head_dim]``. One buffer per layer (rather than
one stacked ``[n_layers, ...]`` array) means each layer's write is a
``dynamic_update_slice`` into its own donated buffer - trivially in place under ``jit`` -
and the model's python loop over layers never slices or re-stacks a large array.

Slot ``s`` of row ``b`` holds the (already RoPE-rotated) key/value of the token at position
``s`` of that row. Row lengths are *not* stored: they live with the caller (the inference
engine), which passes ``cache_index`` to the model. Entries at or beyond a row's length are
stale or padding and are masked out because they lie in the row's future
(see :func:`jaxlab.model.attention.cache_mask`).

Being a ``flax.struct.dataclass`` the cache is a pytree: ``jax.tree.map`` over it to reset,
slice or copy rows (e.g. ``jax.tree.map(lambda a: a.at[slot].set(row[0]), cache, one)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.config.schema import ModelConfig

Array = jax.Array


@struct.dataclass
class KVCache:
    """Per-layer key/value buffers; ``k[i], v[i]: [batch, max_len, n_kv_heads, head_dim]``."""

    k: tuple[Array, ...]
    v: tuple[Array, ...]

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype: DTypeLike = jnp.float32
) -> KVCache:
    """A zero-filled cache for ``batch`` rows of ``max_len`` slots, stored in ``dtype``.

    Use the compute dtype (e.g. ``precision.compute_dtype``) unless you want a narrower cache;
    values are cast to the compute dtype when read. ``max_len`` must not exceed
    ``cfg.max_seq_len`` for learned positions (the table has that many rows).
    """
    shape = (batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    k = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    v = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
    return KVCache(k=k, v=v)
