"""The decode state: the engine's KV cache plus per-row bookkeeping, all device arrays.

A :class:`DecodeState` with ``B`` rows ("slots") is what the jitted decode loop carries
(and donates) from call to call. A :data:`Prefix` is the same structure with one slot: what
``prefill`` returns for one prompt and ``insert`` copies into a slot of a batched state.

Cache layout (the engine's, not the model's): per layer ``k[i], v[i]`` are
``[slots * n_kv_heads, max_len, head_dim]``, *kv-head major*: row ``b * K + j`` holds kv
head ``j`` of slot ``b``, slot ``s`` along axis 1 holds the (RoPE-rotated) key/value of the
token at position ``s``. The model's own layout is ``[B, max_len, K, D]``
(:class:`jaxlab.model.KVCache`); prefill converts once (:func:`from_model_cache`). Why this
layout is the fast one on XLA:CPU is in ``docs/inference.md``.

Per row ``b``:

* ``tokens[b]``: the last sampled token, not yet in the cache; it sits at position
  ``pos[b]`` and the next decode step writes its K/V to cache slot ``pos[b]``.
* ``pos[b]``: prompt length + tokens fed back so far (the next cache write slot).
* ``generated[b]``: sampled tokens so far (prefill's first token counts), which is also the
  index ``t`` of the next token's key ``fold_in(PRNGKey(seed), t)``.
* ``done[b]``: the row hit a stop token / EOS or its ``max_new_tokens`` budget; empty
  slots are done. Done rows are carried through the batched step but never advance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.typing import DTypeLike

from jaxlab.infer.sampling import SamplingArrays, empty_sampling_arrays
from jaxlab.model import KVCache

Array = jax.Array


@struct.dataclass
class DecodeState:
    k: tuple[Array, ...]  # per layer [slots * K, max_len, D]
    v: tuple[Array, ...]
    tokens: Array  # i32[slots]
    pos: Array  # i32[slots]
    generated: Array  # i32[slots]
    done: Array  # bool[slots]
    sampling: SamplingArrays

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


#: A one-slot :class:`DecodeState` (prefill's output for one prompt).
Prefix = DecodeState


@struct.dataclass
class NaiveState:
    """State of the cache-free path: the whole padded sequence, recomputed every step.

    ``buf[b, :pos[b] + 1]`` holds the prompt and the tokens generated so far; the logits at
    index ``pos[b]`` predict the next token. ``generated``/``done``/``sampling`` are as in
    :class:`DecodeState`.
    """

    buf: Array  # i32[B, max_len]
    pos: Array  # i32[B], index of the last real token
    generated: Array  # i32[B]
    done: Array  # bool[B]
    sampling: SamplingArrays


def from_model_cache(cache: KVCache) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """The model's ``[B, S, K, D]`` layers -> the engine's ``[B * K, S, D]`` (one transpose)."""

    def f(a: Array) -> Array:
        b, s, k, d = a.shape
        return jnp.transpose(a, (0, 2, 1, 3)).reshape(b * k, s, d)

    return tuple(f(a) for a in cache.k), tuple(f(a) for a in cache.v)


def to_model_cache(state: DecodeState) -> KVCache:
    """The engine's cache back in the model's layout (tests, inspection)."""
    b = state.slots

    def f(a: Array) -> Array:
        n, s, d = a.shape
        return jnp.transpose(a.reshape(b, n // b, s, d), (0, 2, 1, 3))

    return KVCache(k=tuple(f(a) for a in state.k), v=tuple(f(a) for a in state.v))


def _zeros(shape: tuple[int, ...], dtype: DTypeLike) -> Array:
    # device_put of host zeros: no per-shape compile (unlike jnp.zeros in eager mode).
    return jax.device_put(np.zeros(shape, jnp.dtype(dtype)))


def empty_decode_state(
    slots: int, n_layers: int, n_kv_heads: int, max_len: int, head_dim: int, dtype: DTypeLike
) -> DecodeState:
    """All slots empty (done) over a zeroed cache."""
    shape = (slots * n_kv_heads, max_len, head_dim)
    # Distinct buffers everywhere: the state is donated, and a buffer may be donated once.
    return DecodeState(
        k=tuple(_zeros(shape, dtype) for _ in range(n_layers)),
        v=tuple(_zeros(shape, dtype) for _ in range(n_layers)),
        tokens=_zeros((slots,), np.int32),
        pos=_zeros((slots,), np.int32),
        generated=_zeros((slots,), np.int32),
        done=jax.device_put(np.ones((slots,), np.bool_)),
        sampling=empty_sampling_arrays(slots),
    )
