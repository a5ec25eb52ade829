"""Reductions over the last axis, in one stage (the reference) or two (for XLA:CPU).

Why two: XLA:CPU emits a reduction over an array's minor axis as a scalar loop per row.
Reduced first across ``[..., n / lanes, lanes]`` chunks (the inner loop is then an
elementwise max of ``lanes``-wide rows, which it vectorises) and then over the ``lanes``
left, the same reduction runs several times faster there; on accelerators the split only
adds a tiny reduce, so they get the one-stage form (:mod:`jaxlab.runtime.tuning`). An
``optimization_barrier`` between the stages keeps XLA's simplifier from folding them back
into one. Figures and the choice of ``lanes``: ``docs/performance.md``.

Max and min are exact under any grouping. A sum is reassociated: it equals the one-pass sum
up to f32 rounding, as any change of summation order would.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxlab.runtime import tuning

Array = jax.Array
ReduceOp = Literal["max", "min", "sum"]

#: Chunk widths tried, widest first: the widest that splits the axis into at least two
#: chunks is used (256 measured fastest for vocabulary-sized axes, docs/performance.md).
LANES = (256, 128, 64, 32, 16)

_OPS = {"max": jnp.max, "min": jnp.min, "sum": jnp.sum}


def lanes_for(n: int) -> int | None:
    """The chunk width for an axis of ``n``: the widest of :data:`LANES` dividing ``n``
    at least twice, or None (then one plain reduce)."""
    return next((w for w in LANES if n % w == 0 and n >= 2 * w), None)


def reduce_last(x: Array, op: ReduceOp, *, two_stage: bool | None = None) -> Array:
    """``op`` over the last axis of ``x`` (``jnp.max`` / ``min`` / ``sum`` with ``axis=-1``).

    ``two_stage``: None takes the platform's choice (:func:`jaxlab.runtime.tuning.current`);
    two stages apply only where :func:`lanes_for` finds a chunk width.
    """
    fn = _OPS[op]
    if two_stage is None:
        two_stage = tuning.current().two_stage_reductions
    n = x.shape[-1]
    lanes = lanes_for(n) if two_stage else None
    if lanes is None:
        return fn(x, axis=-1)
    partial = fn(x.reshape(*x.shape[:-1], n // lanes, lanes), axis=-2)
    return fn(jax.lax.optimization_barrier(partial), axis=-1)


def first_index_of(x: Array, value: Array, *, two_stage: bool | None = None) -> Array:
    """Per row, the first index along the last axis where ``x == value[..., None]`` (int32;
    ``n`` where there is none). With ``value`` the row's max this is ``argmax`` with its
    first-index tie-break, as a min-reduce over the matching positions: XLA:CPU lowers
    ``jnp.argmax`` to a variadic (value, index) reduce that is several times slower, and
    on accelerators the two plain reduces cost about what ``argmax`` does."""
    n = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return reduce_last(jnp.where(x == value[..., None], iota, n), "min", two_stage=two_stage)


def argmax_last(x: Array, *, two_stage: bool | None = None) -> Array:
    """``jnp.argmax(x, -1)`` (first index of the maximum) as two reductions."""
    top = reduce_last(x, "max", two_stage=two_stage)
    return first_index_of(x, top, two_stage=two_stage)


def softmax_last(x: Array, *, two_stage: bool | None = None) -> Array:
    """``jax.nn.softmax(x, axis=-1)`` with both of its reductions by :func:`reduce_last`.

    The maximum is held constant under differentiation, as ``jax.nn.softmax`` does (it
    only shifts the exponent), so gradients are those of the plain formula.
    """
    m = jax.lax.stop_gradient(reduce_last(x, "max", two_stage=two_stage))[..., None]
    e = jnp.exp(x - m)
    return e / reduce_last(e, "sum", two_stage=two_stage)[..., None]


__all__ = [
    "LANES",
    "argmax_last",
    "first_index_of",
    "lanes_for",
    "reduce_last",
    "softmax_last",
]
