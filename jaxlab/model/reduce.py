"""Reductions over the last axis in two stages, which XLA:CPU vectorises.

XLA:CPU emits a reduction over an array's minor (last) axis as a scalar loop per row: a
max over ``f32[16, 8192]`` (a decode step's logits) ran at about 2 elements per
nanosecond, 64 us on the 2-core bench machine. Reduced first across ``[..., n / lanes,
lanes]`` chunks (so the inner loop is an elementwise max of ``lanes``-wide rows, which it
vectorises) and then over the ``lanes`` left, the same max took 13 us. The
``optimization_barrier`` between the two stages keeps XLA's simplifier from folding them
back into one reduce. Measurements and the choice of ``lanes`` are in
``docs/performance.md``; on accelerators the split costs one tiny extra reduce.

Max and min are exact under any grouping. A sum is reassociated: it equals the one-pass
sum up to f32 rounding (ulps), as any change of summation order would.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
ReduceOp = Literal["max", "min", "sum"]

#: Chunk widths tried, widest first: the widest that splits the axis into at least two
#: chunks is used. 256 was the fastest of 16 to 2048 for the vocabulary reductions
#: (``[1 | 16 | 256, 8192]``) on the bench machine.
LANES = (256, 128, 64, 32, 16)

_OPS = {"max": jnp.max, "min": jnp.min, "sum": jnp.sum}


def lanes_for(n: int) -> int | None:
    """The chunk width for an axis of ``n``: the widest of :data:`LANES` dividing ``n``
    at least twice, or None (then one plain reduce)."""
    return next((w for w in LANES if n % w == 0 and n >= 2 * w), None)


def reduce_last(x: Array, op: ReduceOp) -> Array:
    """``op`` over the last axis of ``x`` (``jnp.max`` / ``min`` / ``sum`` with ``axis=-1``),
    in two stages where :func:`lanes_for` finds a chunk width."""
    fn = _OPS[op]
    n = x.shape[-1]
    lanes = lanes_for(n)
    if lanes is None:
        return fn(x, axis=-1)
    partial = fn(x.reshape(*x.shape[:-1], n // lanes, lanes), axis=-2)
    return fn(jax.lax.optimization_barrier(partial), axis=-1)


def first_index_of(x: Array, value: Array) -> Array:
    """Per row, the first index along the last axis where ``x == value[..., None]`` (int32;
    ``n`` where there is none). With ``value`` the row's max this is ``argmax`` with its
    first-index tie-break, as a min-reduce over the matching positions: XLA:CPU lowers
    ``jnp.argmax`` to a variadic (value, index) reduce that is several times slower."""
    n = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return reduce_last(jnp.where(x == value[..., None], iota, n), "min")


def softmax_last(x: Array) -> Array:
    """``jax.nn.softmax(x, axis=-1)`` with both of its reductions in two stages.

    The maximum is held constant under differentiation, as ``jax.nn.softmax`` does (it
    only shifts the exponent), so gradients are those of the plain formula.
    """
    m = jax.lax.stop_gradient(reduce_last(x, "max"))[..., None]
    e = jnp.exp(x - m)
    return e / reduce_last(e, "sum")[..., None]
