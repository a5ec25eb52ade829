"""The decode state: the KV cache plus per-row bookkeeping, all device arrays.

A :class:`DecodeState` with ``B`` rows ("slots") is what the jitted decode loop carries
(and donates) from call to call. A prefix, what ``prefill`` returns, is the same structure
with one row per prompt; ``insert`` copies its rows into slots of a batched state.

The cache is the model's: one cache per layer, in the layout of the model's attention
kernel (:mod:`jaxlab.kernels`). Slot ``s`` of a row holds the key/value of its token at
position ``s``.

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
from flax import struct

from jaxlab.infer.sampling import SamplingArrays
from jaxlab.model import Cache

Array = jax.Array


@struct.dataclass
class DecodeState:
    cache: Cache
    tokens: Array  # i32[slots]
    pos: Array  # i32[slots]
    generated: Array  # i32[slots]
    done: Array  # bool[slots]
    sampling: SamplingArrays
    max_len: int = struct.field(pytree_node=False)

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]


__all__ = ["DecodeState"]
