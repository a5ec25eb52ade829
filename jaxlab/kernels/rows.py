"""Row buckets: compute only a batch's leading rows, up to the last one that is active.

In a continuous-batching decode state, rows past the last busy slot are idle or finished.
On XLA:CPU a decode step's time grows with its rows, so one request on a 16-slot server
should pay for a one-row step, not a sixteen-row one. :class:`Rows` runs a function on the
leading ``r`` rows only, ``r`` the smallest of a few fixed bucket sizes that covers the last
active row (a ``lax.switch``: one compiled program, one branch per size), and pads the
results back to the full batch with zeros. Accelerators use :meth:`Rows.all`
(:attr:`jaxlab.runtime.tuning.Tuning.row_buckets`), on the premise that their step barely
depends on its rows, so the switch would be pure overhead. The TPU v5e's paged decode step
does not bear that out (``docs/performance.md``); buckets have not been tried on the chip.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

#: Row buckets are powers of this below the slot count (16 -> 1, 4, 16).
ROW_BUCKET_BASE = 4


def row_buckets(slots: int) -> tuple[int, ...]:
    """The bucket sizes for ``slots`` rows: ``(1, 4, 16)`` for 16. Each size is one more
    branch in the compiled step: compile time grows with their number, compile count not."""
    out: list[int] = []
    r = 1
    while r < slots:
        out.append(r)
        r *= ROW_BUCKET_BASE
    return (*out, slots)


@dataclass(frozen=True)
class Rows:
    """Which leading rows a step computes: ``sizes[index]`` of ``sizes[-1]`` (trace time)."""

    sizes: tuple[int, ...]
    index: Array | None = None

    @classmethod
    def all(cls, n: int) -> Rows:
        """Every row, no switch."""
        return cls((n,))

    @classmethod
    def up_to_last(cls, active: Array, sizes: tuple[int, ...]) -> Rows:
        """The smallest bucket of ``sizes`` holding every ``active [B]`` row."""
        if len(sizes) == 1:
            return cls(sizes)
        n = active.shape[0]
        last = jnp.max(jnp.where(active, jnp.arange(1, n + 1), 0))  # 1 + last active row
        return cls(sizes, jnp.sum(jnp.asarray(sizes[:-1]) < last))

    @property
    def n(self) -> int:
        return self.sizes[-1]

    def computed(self) -> Array:
        """``bool[n]``: the rows this step computes."""
        if self.index is None:
            return jnp.ones((self.n,), jnp.bool_)
        return jnp.arange(self.n) < jnp.asarray(self.sizes)[self.index]

    def run(self, f: Callable[..., tuple[Array, ...]], *args: Any) -> tuple[Array, ...]:
        """``f(r, *args)`` for ``r`` leading rows, each output zero-padded back to ``n``
        rows. ``f`` slices its row-indexed inputs itself (``x[:r]``)."""
        if self.index is None:
            return f(self.n, *args)

        def branch(r: int) -> Callable[..., tuple[Array, ...]]:
            def run(*a: Any) -> tuple[Array, ...]:
                pad = self.n - r
                return tuple(jnp.pad(o, [(0, pad)] + [(0, 0)] * (o.ndim - 1)) for o in f(r, *a))

            return run

        return tuple(jax.lax.switch(self.index, [branch(r) for r in self.sizes], *args))


__all__ = ["ROW_BUCKET_BASE", "Rows", "row_buckets"]
