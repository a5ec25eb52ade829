"""Prefill chunks: what one ``Engine.prefill`` call is asked to compute, as padded arrays.

A :class:`Chunk` is a run of one sequence's prompt positions, ``start .. start + len - 1``,
with the pages that sequence holds. A whole prompt is one chunk from 0; chunked prefill
splits a long prompt into several calls; prefix caching starts a chunk past the pages
already computed; a preempted request recomputes its prompt and generated tokens as chunks
and continues its token stream at ``generated``.

:func:`batch_chunks` lays a call's chunks out as the arrays the compiled prefill takes:
tokens right-padded to one length bucket, rows padded to a row bucket (powers of two), so
a call compiles once per (length bucket, row bucket, kind) whatever its chunks. Padding
rows hold no page: they write nothing. It checks every chunk against the cache's
capacity and the pool; this module holds no device arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxlab.infer.sampling import SamplingParams


@dataclass(frozen=True)
class Chunk:
    """Prompt positions ``start .. start + len(tokens) - 1`` of one sequence.

    ``pages``: the sequence's page list (at least enough pages for ``start + len(tokens)``
    tokens; more, for the tokens it will decode, are fine). ``last``: the prompt ends with
    this chunk, so its head samples the sequence's next token, with key index
    ``generated`` (0 for a new request; a recomputed request passes the number of its
    generated tokens included in the prompt, and its stream continues where it was).
    """

    tokens: Sequence[int]
    start: int
    pages: Sequence[int]
    sampling: SamplingParams
    last: bool = True
    generated: int = 0
    adapter: int = 0


def row_bucket(n: int) -> int:
    """The rows a prefill of ``n`` chunks computes: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class ChunkBatch:
    """A call's chunks as host arrays of ``rows`` rows (the last ones padding)."""

    tokens: np.ndarray  # i32[rows, bucket], right-padded
    starts: np.ndarray  # i32[rows]
    lengths: np.ndarray  # i32[rows], >= 1 (padding rows: 1)
    table: np.ndarray  # i32[rows, max_pages], NO_PAGE past each row's pages
    generated: np.ndarray  # i32[rows]
    adapters: np.ndarray  # i32[rows], padding rows 0
    samplings: list[SamplingParams]
    from_start: bool  # every chunk starts at position 0

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


#: The sampling of a padding row: any valid values (its outputs are never read).
PADDING_SAMPLING = SamplingParams(max_new_tokens=1)


def batch_chunks(
    chunks: Sequence[Chunk],
    bucket: int,
    *,
    max_len: int,
    page_size: int,
    max_pages: int,
    num_pages: int,
) -> ChunkBatch:
    """``chunks`` padded to ``bucket`` tokens and :func:`row_bucket` rows. ValueError for a
    chunk that is empty, does not fit ``max_len`` or ``bucket``, or whose pages are too few
    for its tokens, too many for the table, or not pages of a ``num_pages`` pool."""
    if not chunks:
        raise ValueError("prefill needs at least one chunk")
    rows = row_bucket(len(chunks))
    tokens = np.zeros((rows, bucket), np.int32)
    starts = np.zeros((rows,), np.int32)
    lengths = np.ones((rows,), np.int32)
    table = np.full((rows, max_pages), num_pages, np.int32)
    generated = np.zeros((rows,), np.int32)
    adapters = np.zeros((rows,), np.int32)
    for i, c in enumerate(chunks):
        n, end = len(c.tokens), c.start + len(c.tokens)
        if n == 0 or c.start < 0 or c.generated < 0:
            raise ValueError(f"chunk {i}: empty, or a negative start or generated offset")
        if n > bucket or end > max_len:
            raise ValueError(
                f"chunk {i}: {n} tokens from position {c.start} exceed the bucket ({bucket})"
                f" or inference.max_len = {max_len}"
            )
        pages = np.asarray(c.pages, np.int32)
        need = -(-end // page_size)
        if not need <= len(pages) <= max_pages:
            raise ValueError(
                f"chunk {i}: {len(pages)} pages for {end} tokens; it needs {need} to"
                f" {max_pages} pages of {page_size} tokens"
            )
        if len(pages) and not (pages.min() >= 0 and pages.max() < num_pages):
            raise ValueError(f"chunk {i}: a page id outside the pool of {num_pages} pages")
        tokens[i, :n] = c.tokens
        starts[i], lengths[i], generated[i] = c.start, n, c.generated
        adapters[i] = c.adapter
        table[i, : len(pages)] = pages
    samplings = [c.sampling for c in chunks] + [PADDING_SAMPLING] * (rows - len(chunks))
    from_start = all(c.start == 0 for c in chunks)
    return ChunkBatch(tokens, starts, lengths, table, generated, adapters, samplings, from_start)


__all__ = ["PADDING_SAMPLING", "Chunk", "ChunkBatch", "batch_chunks", "row_bucket"]
