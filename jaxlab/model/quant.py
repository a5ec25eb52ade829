"""int8 weights: the quantized kernel, the matmul that reads it, and which parameters are
dense layers.

A dense kernel ``[k, n]`` (input features first, output features last) is stored as int8
values and one float32 scale per **output channel** (column): ``w[:, j] ~ q[:, j] *
scale[j]``. Per output channel, because a column's scale then factors out of the dot:

    (x @ (q * scale))[j] = (x @ q)[j] * scale[j]

so the matmul takes the int8 values, accumulates ``x @ q`` like any dot, and applies the
scale to its ``[N, n]`` output: no dequantized copy of the weight is formed by this code. A
column with one large weight only coarsens its own column, where a per-tensor scale would
coarsen every column by the largest weight of the matrix. Per input row would not factor
out (it varies along the contraction).

Two forms of the matmul (:class:`QuantizedKernel.activations`, from
``inference.activations``):

* ``"float"`` (weight-only, the default): ``x`` stays in the compute dtype and meets the
  int8 values in one mixed-type dot (int8 converts exactly to bf16 and f32), accumulating
  in float32. Only the weights lose precision. How the int8 operand reaches the multiplier
  is the backend's business: XLA:CPU (jaxlib 0.10) has no mixed-type or int8 matrix-vector
  kernel, so it converts the weights to float32 and, inside the decode loop, hoists that
  convert out of the loop: a call's steps read a float copy made once per call
  (docs/quantization.md says what that means for speed on the CPU).
* ``"int8"`` (dynamic activations): each row of ``x`` is quantized too (one scale per row,
  made at run time), and the dot is int8 x int8 -> int32, the accelerators' int8 path:
  ``(xq @ q) * x_scale[:, None] * scale``. Exact integer accumulation, but every activation
  is rounded as well.

What this module must not do: decide whether to quantize (the engine does, when it loads
weights, from ``inference.weights``), or change the float model.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.typing import DTypeLike

from jaxlab.kernels import int8

Array = jax.Array
Activations = Literal["float", "int8"]
#: ``[N, k] x [k, n]``: contract the activations' last axis with the kernel's first.
CONTRACT = (((1,), (0,)), ((), ()))


@struct.dataclass
class QuantizedKernel:
    """A dense kernel ``[..., k, n]`` as ``values int8[..., k, n]`` and ``scale f32[..., n]``
    (one per output channel), and how its matmul treats the activations (static).

    It sits where the float kernel sat, inside the same ``nnx.Param``, so the model's code
    reads it with ``param[...]`` and :func:`jaxlab.model.layers.dense` dispatches on it.
    Leading axes (a ``scan_layers`` model's layer axis) are carried along and sliced like
    any parameter."""

    values: Array
    scale: Array
    activations: Activations = struct.field(pytree_node=False, default="float")

    def __getitem__(self, index: Any) -> QuantizedKernel:
        # ``param[...]`` reads a variable's value; only the whole-value read is meaningful.
        if index is not Ellipsis:
            raise TypeError(f"a quantized kernel is read whole (param[...]), not [{index!r}]")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def dequantize(self, dtype: DTypeLike = jnp.float32) -> Array:
        """The float kernel it stands for (tests, inspection; the matmul never forms it)."""
        return int8.dequantize(self.values, self.scale, axis=-2, dtype=dtype)


def quantize_kernel(w: Array, activations: Activations = "float") -> QuantizedKernel:
    """``w [..., k, n]`` -> per-output-channel symmetric int8 (scale over the ``k`` axis)."""
    values, scale = int8.quantize(w, axis=-2)
    return QuantizedKernel(values, scale, activations)


def quantized_matmul(
    x: Array, kernel: QuantizedKernel, compute_dtype: DTypeLike, out_dtype: DTypeLike | None
) -> Array:
    """``x [N, k] @ kernel`` -> ``[N, n]`` in ``out_dtype`` (default ``compute_dtype``),
    with the scales applied to the float32 accumulator (module docstring)."""
    if kernel.activations == "int8":
        xq, x_scale = int8.quantize(x, axis=-1)
        acc = jax.lax.dot_general(xq, kernel.values, CONTRACT, preferred_element_type=jnp.int32)
        y = acc.astype(jnp.float32) * x_scale[:, None] * kernel.scale
    else:
        # The int8 values go into the dot as they are (a mixed-type dot): how they reach the
        # multiplier is the backend's choice (module docstring).
        acc = jax.lax.dot_general(
            x.astype(compute_dtype), kernel.values, CONTRACT, preferred_element_type=jnp.float32
        )
        y = acc * kernel.scale
    return y.astype(compute_dtype if out_dtype is None else out_dtype)


def is_dense_path(path: tuple[Any, ...], value: Any) -> bool:
    """Whether the parameter at ``path`` is a dense layer's kernel: every matrix inside the
    blocks (the attention's QKV and output projections, the MLP's), and an untied LM head.
    Norm gains are vectors (per layer) and the embedding tables are lookups: they stay as
    they are."""
    if isinstance(value, QuantizedKernel):
        return False  # already quantized
    if tuple(path) == ("lm_head",):
        return True
    # A scan_layers model's block parameters carry a leading layer axis.
    matrix = 3 if tuple(path[:2]) == ("blocks", "stacked") else 2
    return path[0] == "blocks" and getattr(value, "ndim", 0) >= matrix


def _quantize_dense(params: nnx.State, activations: Activations) -> nnx.State:
    pairs = []
    for path, var in nnx.to_flat_state(params):
        value = var.get_value()
        if is_dense_path(path, value):
            var = var.replace(value=quantize_kernel(value, activations))
        pairs.append((path, var))
    return nnx.from_flat_state(pairs)


#: One compile per parameter structure, instead of one per eager op and shape.
_quantize_dense_jit = jax.jit(_quantize_dense, static_argnums=(1,))


def quantize_dense(params: nnx.State, activations: Activations = "float") -> nnx.State:
    """``params`` with every dense kernel (:func:`is_dense_path`) replaced by its
    :class:`QuantizedKernel`; the other parameters are the same arrays. Idempotent."""
    return _quantize_dense_jit(params, activations)


_quantize_head_jit = jax.jit(
    lambda table, activations: quantize_kernel(table.T, activations), static_argnums=(1,)
)


def quantize_tied_head(table: Array, activations: Activations = "float") -> QuantizedKernel:
    """A tied LM head ``[vocab, d_model]`` (the embedding table) as a quantized ``[d_model,
    vocab]`` kernel, one scale per vocabulary entry; the table itself stays float for the
    embedding lookups."""
    return _quantize_head_jit(table, activations)


def weight_bytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (a quantized kernel counts its values and scales)."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


__all__ = [
    "Activations",
    "QuantizedKernel",
    "is_dense_path",
    "quantize_dense",
    "quantize_kernel",
    "quantize_tied_head",
    "quantized_matmul",
    "weight_bytes",
]
