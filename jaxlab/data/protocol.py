"""The two shapes the data package trades in: what it needs from a tokenizer, and a batch.

Kept in their own module so every other module (and any caller) can import them without
pulling in the cache or loader machinery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenizerLike(Protocol):
    """The part of ``jaxlab.tokenizer.Tokenizer`` the data pipeline relies on.

    Only this is used, so any object with these members works (tests use a byte stand-in).
    ``encode_batch`` must encode text *ordinarily*: special-token strings inside a document
    must not become ``eot_id``; the cache appends ``eot_id`` itself after every document.
    """

    @property
    def n_vocab(self) -> int:
        """Total ids including the special tokens; decides uint16 vs uint32 storage."""
        ...

    @property
    def eot_id(self) -> int:
        """``<|endoftext|>``: written after every document, marks segment ends."""
        ...

    @property
    def pad_id(self) -> int:
        """``<|pad|>``: fills the padding rows of the last eval batch."""
        ...

    @property
    def sha256(self) -> str:
        """Stable content hash; part of the cache key, so a new tokenizer re-tokenizes."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids for each text, in order."""
        ...


# One (per-process) batch of packed windows: a plain dict, so it is a JAX pytree as is and
# ``{k: f(v) for k, v in batch.items()}`` type-checks. Keys (all ``[B, T]``, ``T = seq_len``):
#   tokens       int32    model inputs (window[:-1])
#   targets      int32    next tokens (window[1:])
#   positions    int32    0 at each segment start, counting up within the segment
#   segment_ids  int32    1, 1, ..., 2, 2, ... within a row; 0 only on padding rows
#   loss_mask    float32  1 where the target continues the input's document, else 0
#                         (and, from a chat-jsonl store, is an assistant reply's token)
Batch = dict[str, np.ndarray]

BATCH_KEYS: tuple[str, ...] = ("tokens", "targets", "positions", "segment_ids", "loss_mask")
