"""The decode state: the engine's KV cache plus per-row bookkeeping, all device arrays.

A :class:`DecodeState` with ``B`` rows ("slots") is what the jitted decode loop carries
(and donates) from call to call. A :data:`Prefix` is the same structure with one slot: what
``prefill`` returns for one prompt and ``insert`` copies into a slot of a batched state.

Cache layout (the engine's, not the model's): per layer ``k[i], v[i]`` are tuples of
**blocks** ``[slots * n_kv_heads, block, head_dim]`` that together cover ``max_len`` cache
slots (:func:`cache_blocks`), *kv-head major*: row ``b * K + j`` holds kv head ``j`` of slot
``b``; cache slot ``s`` (block ``s // block``, offset ``s % block``) holds the
(RoPE-rotated) key/value of the token at position ``s``. Separate buffers per block let
the decode step read only the blocks some row can see without slicing (a slice of the
slot axis is a copy on XLA:CPU). The model's own layout is ``[B, max_len, K, D]``
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

import itertools

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
    k: tuple[tuple[Array, ...], ...]  # per layer, per block [slots * K, block, D]
    v: tuple[tuple[Array, ...], ...]
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
        return sum(b.shape[1] for b in self.k[0])


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


#: Caches at least this long are split into :data:`N_BLOCKS` blocks; shorter ones are one.
MIN_BLOCKED_LEN = 64
N_BLOCKS = 4


def cache_blocks(max_len: int) -> tuple[int, ...]:
    """Block sizes of a ``max_len`` cache: :data:`N_BLOCKS` near-equal blocks (multiples of 8
    but the last), or one block under :data:`MIN_BLOCKED_LEN` slots.

    Four blocks is the measured trade-off on XLA:CPU: each block is one more small dot per
    layer at batch 1, while at batch 16 reading a quarter of the cache less is worth ~0.4 ms
    a step on bench-small (``docs/inference.md``).
    """
    if max_len < MIN_BLOCKED_LEN:
        return (max_len,)
    size = -(-max_len // N_BLOCKS)
    size = -(-size // 8) * 8
    full, rest = divmod(max_len, size)
    return (size,) * full + ((rest,) if rest else ())


def block_starts(blocks: tuple[int, ...]) -> tuple[int, ...]:
    """First cache slot of each block."""
    return tuple(itertools.accumulate(blocks[:-1], initial=0))


def split_blocks(rows: Array) -> tuple[Array, ...]:
    """``[N, max_len, D]`` -> its :func:`cache_blocks` along axis 1 (static slices)."""
    sizes = cache_blocks(rows.shape[1])
    return tuple(rows[:, at : at + n] for at, n in zip(block_starts(sizes), sizes, strict=True))


def from_model_cache(
    cache: KVCache, max_len: int | None = None
) -> tuple[tuple[tuple[Array, ...], ...], tuple[tuple[Array, ...], ...]]:
    """The model's ``[B, S, K, D]`` layers -> the engine's blocks of ``[B * K, block, D]``
    covering ``max_len >= S`` slots (default ``S``): one transpose, zeros for the slots
    past ``S``, then static slices."""
    cap = cache.max_len if max_len is None else max_len
    if cap < cache.max_len:
        raise ValueError(f"max_len {cap} is shorter than the cache ({cache.max_len} slots)")

    def f(a: Array) -> tuple[Array, ...]:
        b, s, k, d = a.shape
        rows = jnp.transpose(a, (0, 2, 1, 3)).reshape(b * k, s, d)
        return split_blocks(jnp.pad(rows, ((0, 0), (0, cap - s), (0, 0))))

    return tuple(f(a) for a in cache.k), tuple(f(a) for a in cache.v)


def to_model_cache(state: DecodeState) -> KVCache:
    """The engine's cache back in the model's layout (tests, inspection)."""
    b = state.slots

    def f(blocks: tuple[Array, ...]) -> Array:
        a = jnp.concatenate(blocks, axis=1)
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
    sizes = cache_blocks(max_len)

    def layer() -> tuple[Array, ...]:
        return tuple(_zeros((slots * n_kv_heads, n, head_dim), dtype) for n in sizes)

    # Distinct buffers everywhere: the state is donated, and a buffer may be donated once.
    return DecodeState(
        k=tuple(layer() for _ in range(n_layers)),
        v=tuple(layer() for _ in range(n_layers)),
        tokens=_zeros((slots,), np.int32),
        pos=_zeros((slots,), np.int32),
        generated=_zeros((slots,), np.int32),
        done=jax.device_put(np.ones((slots,), np.bool_)),
        sampling=empty_sampling_arrays(slots),
    )
