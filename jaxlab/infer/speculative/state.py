"""The decode state of speculative decoding: the engine's, plus what a proposer reads and the
per-row acceptance counters. All device arrays, donated from call to call.

Everything a proposer needs is kept in pages, through the decode state's one page table,
like the K/V:

* ``history``: a token-id pool ``i32[num_pages, page_size]``, row ``b``'s token at position
  ``p`` in page ``table[b, p // page_size]``. It holds what the K/V pages hold (the tokens
  of the cached positions), written by the same calls: prefill writes each chunk's tokens,
  a decode call the tokens it fed and kept. So chunked prefill, a recomputed (preempted)
  request and a prefix-cache hit need nothing of their own: a cached prompt page's tokens
  are its hash key.
* ``draft``: the draft model's KV pools (none for prompt lookup), one per draft layer, in
  its paged kernel's layout; same pages, same table.

Per row (reset by ``insert``): ``drafted`` and ``accepted`` count the tokens drafted for it
and accepted so far, and ``on`` says whether it still speculates (it stops for good when
too few drafts are accepted: :class:`~jaxlab.config.SpeculativeConfig`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from flax import struct

from jaxlab.infer.state import DecodeState
from jaxlab.kernels.paged import PagedCache

Array = jax.Array


@struct.dataclass
class SpecState:
    target: DecodeState
    history: Array  # i32[num_pages, page_size]
    draft: tuple[PagedCache, ...]
    drafted: Array  # i32[slots]
    accepted: Array  # i32[slots]
    on: Array  # bool[slots]

    @property
    def slots(self) -> int:
        return self.target.slots

    @property
    def table(self) -> Array:
        return self.target.table


@struct.dataclass
class SpecStats:
    """What one decode call did per row: tokens drafted and accepted in the call, and
    whether the row still speculates at its end (output buffers of their own, valid after
    the state is donated to the next call)."""

    drafted: Array  # i32[slots]
    accepted: Array  # i32[slots]
    on: Array  # bool[slots]


@dataclass(frozen=True)
class SpecUsage:
    """What speculation did for one request, on the host: tokens drafted for it and
    accepted, and whether it switched speculation off (acceptance too low to pay)."""

    method: str
    draft_tokens: int = 0
    accepted_tokens: int = 0
    switched_off: bool = False

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def doc(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "switched_off": self.switched_off,
        }


__all__ = ["SpecState", "SpecStats", "SpecUsage"]
