"""Building blocks: initialisers, the precision-aware matmul, RMSNorm, embeddings, MLP, dropout.

Design rules shared by every layer here:

* **No biases anywhere.** Modern decoder LMs (PaLM, LLaMA) drop them: they add parameters
  and memory traffic but no measurable quality at this scale, and without them every
  projection is a single ``dot``. The GPT-2-like variant therefore differs from GPT-2 in
  this respect (and in using RMSNorm instead of LayerNorm); see ``docs/model.md``.
* **Parameters live in ``param_dtype``; matmul inputs are cast to ``compute_dtype``** at the
  point of use (:func:`dense`). The cast of a parameter is a no-op when both dtypes agree,
  and under ``jit`` XLA fuses it into the consumer.
* **The residual stream is float32.** Norms read it in f32 and return f32; only the matmul
  inputs get narrowed. That keeps bf16 rounding out of the sum of many residual branches.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from jaxlab.model.quant import QuantizedKernel, quantized_matmul

if TYPE_CHECKING:
    from jaxlab.model.lora import Lora

Array = jax.Array

#: Standard deviation of every embedding and projection at initialisation (GPT-2).
INIT_STD = 0.02


def normal_init(key: Array, shape: tuple[int, ...], std: float, dtype: DTypeLike) -> Array:
    """``N(0, std^2)`` drawn in float32 and then stored in ``dtype``.

    Drawing in f32 first makes the initial values independent of the storage dtype (a bf16
    model is the rounded f32 model, not a different random draw).
    """
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)


def residual_std(n_layers: int) -> float:
    """Init std of projections that write into the residual stream: 0.02 / sqrt(2 L).

    Each block adds two branches (attention, MLP) to the residual stream, so ``2 L`` terms are
    summed; scaling their output projections keeps the stream's variance O(1) at init
    (GPT-2 paper, section 2.3).
    """
    return INIT_STD / math.sqrt(2 * n_layers)


def dense(
    x: Array,
    kernel: Array | QuantizedKernel,
    compute_dtype: DTypeLike,
    out_dtype: DTypeLike | None = None,
) -> Array:
    """``x @ kernel`` with both inputs cast to ``compute_dtype``.

    ``out_dtype`` (``preferred_element_type``) lets a bf16 matmul hand back its f32
    accumulator directly - used where the result feeds the f32 residual stream or the
    logits, so no precision is thrown away by a round trip through bf16.

    The leading axes are flattened first, so the matmul is a plain 2-D ``[N, k] @ [k, n]``.
    Same result; but its transpose (the kernel gradient ``x^T @ dy``) is then also a 2-D dot
    that XLA:CPU runs in place, where the ``[B, T, k]`` form makes it materialise a
    transposed copy of ``dy`` fused with the producer (several times slower on CPU, see
    ``docs/performance.md``).

    An int8 kernel (:class:`~jaxlab.model.quant.QuantizedKernel`, inference with
    ``inference.weights = "int8"``) runs :func:`~jaxlab.model.quant.quantized_matmul`: the
    same product, its scales applied to the accumulator.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(kernel, QuantizedKernel):
        y = quantized_matmul(x2, kernel, compute_dtype, out_dtype)
    else:
        y = jnp.matmul(
            x2.astype(compute_dtype), kernel.astype(compute_dtype), preferred_element_type=out_dtype
        )
    return y.reshape(*lead, kernel.shape[-1])


def dropout(x: Array, rate: float, key: Array | None) -> Array:
    """Inverted dropout driven by an explicit key; identity when ``key`` is None or rate is 0.

    No hidden RNG state: the same key always drops the same units, so a training step is a
    pure function of (params, batch, key).
    """
    if key is None or rate == 0.0:
        return x
    keep = 1.0 - rate
    mask = jax.random.bernoulli(key, keep, x.shape)
    return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) with a learned per-channel gain.

    Always computed in float32 and returns float32, whatever the input or parameter dtype:
    the mean of squares is where low precision hurts most.
    """

    def __init__(self, dim: int, *, eps: float, param_dtype: DTypeLike) -> None:
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return x32 * inv_rms * self.scale[...].astype(jnp.float32)


class Embedding(nnx.Module):
    """A lookup table ``[num, dim]``; row ``i`` is the vector of id ``i``.

    Used for tokens (and, when tied, as the LM head via :meth:`attend`) and for the learned
    absolute position table. Lookups return float32 (the residual stream's dtype).
    """

    def __init__(self, num: int, dim: int, *, param_dtype: DTypeLike, rngs: nnx.Rngs) -> None:
        self.table = nnx.Param(normal_init(rngs.params(), (num, dim), INIT_STD, param_dtype))

    def __call__(self, ids: Array) -> Array:
        # Plain indexing: out-of-range ids are clamped (JAX gather semantics), never NaN.
        return self.table[...][ids].astype(jnp.float32)

    def attend(self, h: Array, compute_dtype: DTypeLike) -> Array:
        """Tied output projection ``h @ table^T`` with an f32 result (the logits)."""
        table = self.table[...].astype(compute_dtype)
        return jnp.einsum(
            "...d,vd->...v",
            h.astype(compute_dtype),
            table,
            preferred_element_type=jnp.float32,
        )


class MLP(nnx.Module):
    """Position-wise feed-forward block, ``swiglu`` or ``gelu``.

    * ``swiglu`` (Shazeer 2020): ``down(silu(x W_gate) * (x W_up))``. The gate and up
      kernels are stored **fused** as one ``[d_model, 2 * d_mlp]`` kernel (gate first, up
      second) so ``x`` is read once and one larger matmul replaces two; the parameter count
      is identical to separate ``gate``/``up`` kernels.
    * ``gelu`` (GPT-2): ``down(gelu_tanh(x W_up))``.

    ``down`` writes into the residual stream, so it gets the ``1/sqrt(2 L)`` scaled init and
    returns its f32 accumulator.
    """

    def __init__(
        self,
        d_model: int,
        d_mlp: int,
        kind: Literal["swiglu", "gelu"],
        *,
        n_layers: int,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> None:
        self.kind = kind
        self.d_mlp = d_mlp
        self.compute_dtype = compute_dtype
        width = 2 * d_mlp if kind == "swiglu" else d_mlp
        self.w_in = nnx.Param(normal_init(rngs.params(), (d_model, width), INIT_STD, param_dtype))
        self.w_down = nnx.Param(
            normal_init(rngs.params(), (d_mlp, d_model), residual_std(n_layers), param_dtype)
        )

    def __call__(self, x: Array, lora: Lora | None = None) -> Array:
        """``lora``: adapters on ``w_in`` (``mlp_in``) and ``w_down`` (``mlp_down``)."""
        h = dense(x, self.w_in[...], self.compute_dtype)
        if lora is not None:
            h = _plus(h, lora.delta("mlp_in", x, self.compute_dtype))
        if self.kind == "swiglu":
            gate, up = h[..., : self.d_mlp], h[..., self.d_mlp :]
            h = jax.nn.silu(gate) * up
        else:
            h = jax.nn.gelu(h, approximate=True)
        y = dense(h, self.w_down[...], self.compute_dtype, jnp.float32)
        if lora is not None:
            y = _plus(y, lora.delta("mlp_down", h, self.compute_dtype))
        return y


def _plus(y: Array, delta: Array | None) -> Array:
    """``y + delta`` in ``y``'s dtype (no adapter: ``y`` itself)."""
    return y if delta is None else y + delta.astype(y.dtype)
