"""The static plan of the flash-attention kernel: tile sizes, padding, and which tiles run.

Everything here is decided from shapes alone, in NumPy, before anything is traced: the
Pallas kernels in :mod:`jaxlab.kernels.pallas_flash` only read the tables it makes.

Causal attention touches only the tiles on or below the diagonal of the ``[T, T]`` logits.
Rather than walk the full ``nq x nk`` grid of tiles and skip the upper ones inside the
kernel (each skipped grid step still costs its pipeline overhead), the grid walks a flat
list of the tiles that can hold a visible (query, key) pair: :meth:`FlashPlan.q_major`
orders them query block by query block (forward and ``dq``: a query tile accumulates over
its keys), :meth:`FlashPlan.k_major` key block by key block (``dk, dv``: a key tile
accumulates over its queries). The kernels get the tables as scalar-prefetch operands
(SMEM) and look their tile up from the step number.

Sequences are padded at the end to a multiple of every tile size; padded keys lie in
every real query's future, so causality already hides them, and query blocks made only
of padding are left out of the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: TPU vector registers are 128 lanes wide: a tile's key (forward) or query (backward)
#: extent lies on the lanes, so tile sizes are multiples of it.
LANES = 128


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes along the sequence: ``q`` query rows and ``k`` key rows per grid step of
    the forward kernel; ``q_bwd`` and ``k_bwd`` the same for both backward kernels
    (default: the forward's). Multiples of :data:`LANES`; clamped for short sequences.

    The defaults were chosen on TPU v5e at head_dim 64 (``docs/kernels.md``, Tiles).
    """

    q: int = 512
    k: int = 512
    q_bwd: int | None = None
    k_bwd: int | None = None

    def __post_init__(self) -> None:
        for field in ("q", "k", "q_bwd", "k_bwd"):
            value = getattr(self, field)
            if value is not None and (value <= 0 or value % LANES):
                raise ValueError(
                    f"BlockSizes.{field}: must be a positive multiple of {LANES} "
                    f"(TPU lanes), got {value}"
                )

    @property
    def backward(self) -> tuple[int, int]:
        return (self.q_bwd or self.q, self.k_bwd or self.k)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class FlashPlan:
    """Tiles of one sequence length: ``bq`` query rows and ``bk`` key rows per tile over a
    sequence of ``length`` real tokens padded to ``padded``."""

    length: int
    padded: int
    bq: int
    bk: int

    @property
    def q_blocks(self) -> int:
        """Query blocks holding at least one real token (the rest are never computed)."""
        return -(-self.length // self.bq)

    @property
    def k_blocks(self) -> int:
        return -(-self.length // self.bk)

    def last_k(self, qi: int) -> int:
        """The last key block query block ``qi`` sees: the one holding its last query."""
        return min(((qi + 1) * self.bq - 1) // self.bk, self.k_blocks - 1)

    def first_q(self, ki: int) -> int:
        """The first query block that sees key block ``ki``: the one holding its first key."""
        return ki * self.bk // self.bq

    def q_major(self) -> tuple[np.ndarray, np.ndarray]:
        """``(qi, ki)`` of every tile on or below the diagonal, query block by query block,
        keys ascending within each (forward and ``dq``)."""
        pairs = [(qi, ki) for qi in range(self.q_blocks) for ki in range(self.last_k(qi) + 1)]
        return _columns(pairs)

    def k_major(self) -> tuple[np.ndarray, np.ndarray]:
        """The same tiles, key block by key block, queries ascending within each (``dk, dv``)."""
        pairs = [
            (qi, ki) for ki in range(self.k_blocks) for qi in range(self.first_q(ki), self.q_blocks)
        ]
        return _columns(pairs)


def _columns(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.asarray(pairs, np.int32).reshape(-1, 2)
    return arr[:, 0].copy(), arr[:, 1].copy()


def clamp(block: int, length: int) -> int:
    """``block``, or if the sequence is shorter, the fewest lanes times a power of two that
    cover it: tiles given as powers of two stay powers of two, so their common multiple
    (what the sequence is padded to) stays the largest of them."""
    lanes = -(-length // LANES)
    return min(block, LANES * (1 << (lanes - 1).bit_length()))


def padded_length(length: int, blocks: BlockSizes) -> int:
    """``length`` rounded up to a multiple of every (clamped) tile size, forward and
    backward, so one padded array serves all three kernels."""
    sizes = [clamp(b, length) for b in (blocks.q, blocks.k, *blocks.backward)]
    return round_up(length, math.lcm(*sizes))


def plans(length: int, blocks: BlockSizes) -> tuple[FlashPlan, FlashPlan]:
    """``(forward, backward)`` plans of a sequence of ``length`` tokens."""
    if length < 1:
        raise ValueError(f"flash attention needs at least one token, got length {length}")
    padded = padded_length(length, blocks)
    fwd = FlashPlan(length, padded, clamp(blocks.q, length), clamp(blocks.k, length))
    bq, bk = blocks.backward
    bwd = FlashPlan(length, padded, clamp(bq, length), clamp(bk, length))
    return fwd, bwd


__all__ = ["LANES", "BlockSizes", "FlashPlan", "clamp", "padded_length", "plans", "round_up"]
