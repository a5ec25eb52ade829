"""Symmetric int8 quantization along one axis: the rounding both int8 weights
(:mod:`jaxlab.model.quant`) and the int8 KV pool (:mod:`jaxlab.kernels.paged`) use.

A slice along ``axis`` is stored as int8 values ``q`` and one float32 scale
``s = max |x| / 127`` (symmetric: no zero point, so a product of two quantized numbers needs
no correction terms), and read back as ``q * s``. Rounding is to nearest, so each element
is off by at most ``s / 2`` (plus float32 rounding of the division, far below it). An
all-zero slice gets scale 0 and reads back as zeros.

What this module must not do: decide what is quantized, or when (the config and the engine
do), or hold the matmuls that read int8 weights (:mod:`jaxlab.model.quant`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

Array = jax.Array

#: The largest int8 magnitude used: -127..127, symmetric (-128 is never produced).
INT8_MAX = 127


def quantize(x: Array, axis: int) -> tuple[Array, Array]:
    """``(q int8, scale f32)``: ``x`` with one scale per slice along ``axis`` (the axis is
    reduced out of ``scale``); ``q * expand_dims(scale, axis)`` approximates ``x`` within
    ``scale / 2`` per element."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=axis) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)  # an all-zero slice: q = 0, scale 0
    q = jnp.round(x32 / jnp.expand_dims(safe, axis))
    return jnp.clip(q, -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def dequantize(q: Array, scale: Array, axis: int, dtype: DTypeLike = jnp.float32) -> Array:
    """``q * scale`` (``scale`` broadcast along ``axis``) in ``dtype``."""
    return (q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)


__all__ = ["INT8_MAX", "dequantize", "quantize"]
