"""The attention layer: projections, rotary positions, and a call into a kernel.

This module owns what attention does *around* the kernel: the fused QKV projection, RoPE,
and the output projection. The attention math itself (and the decode cache's layout) is the
kernel's, chosen by name (:mod:`jaxlab.kernels`); it is never restated here. A paged cache
is read by the kernel's paged counterpart (:data:`jaxlab.kernels.PAGED_FOR`), picked by the
type of the cache it is handed.

Shapes: ``B`` batch, ``T`` new tokens, ``H`` query heads, ``K`` kv heads, ``D`` head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from jaxlab import kernels
from jaxlab.kernels import AttentionKernel, LayerCache, PagedKernel
from jaxlab.kernels.paged import PagedCache, PagedLayer
from jaxlab.model import lora as lora_math
from jaxlab.model.layers import INIT_STD, dense, normal_init, residual_std
from jaxlab.model.lora import Lora

Array = jax.Array
Rope = tuple[Array, Array]


def rope_tables(positions: Array, head_dim: int, theta: float) -> Rope:
    """``(sin, cos)``, each ``f32[B, T, 1, D/2]``, for rotary embeddings at ``positions``.

    Computed once per forward pass and shared by every layer (it depends only on positions).
    Frequencies follow RoFormer: ``theta^(-2i/D)`` for ``i < D/2``.
    """
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]


def apply_rope(x: Array, sin: Array, cos: Array) -> Array:
    """Rotate ``x: [B, T, N, D]`` by the angles in ``sin``/``cos``; computed in f32.

    Uses the "half-split" pairing (channel ``i`` with ``i + D/2``, as in GPT-NeoX/LLaMA)
    rather than interleaved pairs: contiguous halves avoid strided gathers. The result is
    cast back to ``x.dtype``.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head self-attention with grouped-query KV heads and a fused QKV projection.

    Parameters (no biases):

    * ``w_qkv``: ``[d_model, (H + 2K) * D]`` - one matmul produces Q, K and V; columns are
      ``[q heads | k heads | v heads]``, each head ``D`` wide.
    * ``w_out``: ``[H * D, d_model]`` - residual output projection (scaled init).

    ``kernel`` is a resolved kernel name (``jaxlab.kernels.resolve``): a plain string keeps
    the graphdef hashable.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        *,
        n_layers: int,
        kernel: str,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ) -> None:
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.kernel_name = kernels.resolve(kernel)
        self.compute_dtype = compute_dtype
        width = (n_heads + 2 * n_kv_heads) * self.head_dim
        self.w_qkv = nnx.Param(normal_init(rngs.params(), (d_model, width), INIT_STD, param_dtype))
        self.w_out = nnx.Param(
            normal_init(
                rngs.params(),
                (n_heads * self.head_dim, d_model),
                residual_std(n_layers),
                param_dtype,
            )
        )

    @property
    def kernel(self) -> AttentionKernel:
        return kernels.KERNELS[self.kernel_name]

    @property
    def paged_kernel(self) -> PagedKernel:
        return kernels.PAGED_KERNELS[kernels.PAGED_FOR[self.kernel_name]]

    def kernel_for(self, cache: LayerCache) -> AttentionKernel | PagedKernel:
        """The kernel that reads ``cache``: the paged one for a :class:`PagedLayer`."""
        return self.paged_kernel if isinstance(cache, PagedLayer) else self.kernel

    def project(
        self, x: Array, rope: Rope | None, lora: Lora | None = None
    ) -> tuple[Array, Array, Array]:
        """``x [B, T, d_model]`` -> ``q [B, T, H, D]``, ``k, v [B, T, K, D]``, RoPE applied
        (keys are cached already rotated); ``lora``'s q/k/v adapters added."""
        b, t, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = dense(x, self.w_qkv[...], self.compute_dtype)
        qkv = lora_math.add_qkv(qkv, x, lora, self.compute_dtype, h * d, kv * d)
        # Named for the remat policies that keep it (``jaxlab.model.remat``); no-op otherwise.
        qkv = checkpoint_name(qkv, "qkv_proj")
        qkv = qkv.reshape(b, t, h + 2 * kv, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
        if rope is not None:
            sin, cos = rope
            q = apply_rope(q, sin, cos)
            k = apply_rope(k, sin, cos)
        return q, k, v

    def output(self, o: Array, lora: Lora | None = None) -> Array:
        """The kernel's ``[B, T, H, D]`` -> f32 ``[B, T, d_model]`` (into the residual)."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.n_heads * self.head_dim)
        out = dense(o, self.w_out[...], self.compute_dtype, jnp.float32)
        out = lora_math.add(out, "o", o, lora, self.compute_dtype)
        return checkpoint_name(out, "out_proj")

    def __call__(
        self,
        x: Array,
        rope: Rope | None,
        segment_ids: Array | None = None,
        lora: Lora | None = None,
    ) -> tuple[Array, tuple[Array, Array]]:
        """Causal self-attention over ``x [B, T, d_model]`` (within segments when given).

        Returns the output and this layer's new ``(k, v)``, which prefill turns into a
        cache (unused in training, where jit drops them).
        """
        q, k, v = self.project(x, rope, lora)
        return self.output(self.kernel.attend(q, k, v, segment_ids), lora), (k, v)

    def attend_cache(
        self, q: Array, cache: LayerCache, positions: Array, lora: Lora | None = None
    ) -> Array:
        """Queries over a cache (contiguous, or a paged layer) that already holds their own
        keys -> f32 ``[B, T, d]``."""
        return self.output(self.kernel_for(cache).attend_cache(q, cache, positions), lora)

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike) -> LayerCache:
        return self.kernel.init_cache(batch, max_len, self.n_kv_heads, self.head_dim, dtype)

    def init_pool(self, num_pages: int, page_size: int, dtype: DTypeLike) -> PagedCache:
        return self.paged_kernel.init_pool(
            num_pages, page_size, self.n_kv_heads, self.head_dim, dtype
        )


__all__ = ["Attention", "Rope", "apply_rope", "rope_tables"]
