"""The decode state: the paged KV cache plus per-row bookkeeping, all device arrays.

A :class:`DecodeState` with ``B`` rows ("slots") is what the jitted decode loop carries
(and donates) from call to call. A prefix, what ``prefill`` returns, is the same structure
with one row per chunk and no pools, only the chunks' page-table rows; ``insert`` copies
its rows (table rows included) into slots of a batched state.

The cache is a :class:`~jaxlab.kernels.paged.Pages`: one pool of pages per layer, in the
layout of the model's paged kernel (:mod:`jaxlab.kernels`), and the page table
``i32[B, max_pages]`` that every layer shares. Row ``b``'s token at position ``p`` lives in
page ``table[b, p // page_size]``; which row holds which page is the host's decision
(:class:`~jaxlab.infer.pages.PagePool`), and ``Engine.set_table`` brings it to the device.

Per row ``b``:

* ``tokens[b]``: the last sampled token, not yet in the cache; it sits at position
  ``pos[b]`` and the next decode step writes its K/V there, through the table.
* ``pos[b]``: tokens in the cache so far (prompt + tokens fed back): the next write.
* ``generated[b]``: sampled tokens so far (prefill's first token counts), which is also the
  index ``t`` of the next token's key ``fold_in(PRNGKey(seed), t)``.
* ``adapter[b]``: the row's LoRA adapter id (:data:`~jaxlab.model.lora.NO_ADAPTER`, 0:
  the base model); data, not shape, so rows of different adapters share one compiled step.
* ``done[b]``: the row hit a stop token / EOS or its ``max_new_tokens`` budget; empty
  slots are done. Done rows are carried through the batched step but never advance, and
  write nothing: their pages may belong to another row by now.

And one host fact, not an array: ``span``, a length that holds every page the table names
(:func:`jaxlab.kernels.staged.stage_length`; None: not known, so ``max_len``). The
engine sets it wherever the host hands it a table (``set_table``, ``insert``) and a staged
decode call stages only that much of each row (:mod:`jaxlab.kernels.staged`). It is static
pytree data: the engine keys its decode calls by it and hands every jitted function the
state without it, so no other compile depends on it.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from jaxlab.infer.sampling import SamplingArrays
from jaxlab.kernels.paged import Pages

Array = jax.Array


@struct.dataclass
class DecodeState:
    cache: Pages
    tokens: Array  # i32[slots]
    pos: Array  # i32[slots]
    generated: Array  # i32[slots]
    done: Array  # bool[slots]
    sampling: SamplingArrays
    adapter: Array  # i32[slots]
    max_len: int = struct.field(pytree_node=False)
    span: int | None = struct.field(pytree_node=False, default=None)

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def staged_len(self) -> int:
        """How much of each row a staged decode call stages: ``span``, else ``max_len``."""
        return self.max_len if self.span is None else self.span

    @property
    def table(self) -> Array:
        """The page table ``i32[slots, max_pages]``."""
        return self.cache.table

    def with_done(self, done: Array) -> DecodeState:
        """This state with its ``done`` flags replaced (the decode loop's carries share it)."""
        return dataclasses.replace(self, done=done)


__all__ = ["DecodeState"]
