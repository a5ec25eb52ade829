"""LoRA: low-rank adapters on the model's projections, one or many per batch.

This module owns the adapter math and its layout; it never decides what trains, what is
saved or which request gets which adapter (the train and serve services do).

A projection ``y = x @ W`` (``W: [in, out]``) with an adapter becomes (Hu et al. 2021)::

    y = x @ W + (dropout(x) @ A @ B) * scale          scale = alpha / rank

``A: [in, rank]`` starts random (``N(0, 1/in)``), ``B: [rank, out]`` starts at zero, so a
fresh adapter changes nothing. Only ``A`` and ``B`` train; ``W`` stays as it is.

**Projections** (``targets`` in ``train.lora``; :data:`PROJECTIONS` maps each to the
weight names here): ``q``, ``k``, ``v`` adapt their columns of the fused ``w_qkv``
(``[q heads | k heads | v heads]``), ``o`` attention's ``w_out``, and ``mlp`` both MLP
kernels (``mlp_in`` on the fused gate/up ``w_in``, ``mlp_down`` on ``w_down``).

**Layout** (:data:`Weights`): ``{name: {"a": f32[L, N, in, R], "b": f32[L, N, R, out]}}``
for every adapted projection, ``L`` layers, ``N`` adapters, ``R`` the rank. The layer axis
leads whether or not the model scans its layers; a training run holds ``N = 1``.

**Many adapters in one batch** (Punica, S-LoRA, vLLM): :class:`Lora` carries the weights of
``N`` adapters, a ``scale f32[N]`` and ``ids int32[B]``, each batch row's adapter. Each row
gathers its own ``A`` and ``B`` and the low-rank product is one batched einsum
(``[B, T, in] x [B, in, R] -> [B, T, R]``, then ``x [B, R, out]``), so rows of different
adapters share one step. :func:`stack` puts an all-zero adapter in slot
:data:`NO_ADAPTER` (0): rows with that id compute exactly the base model. ``ids = None``
means every row uses slot 0 without a gather (training, one adapter).

**Merging** (:func:`merge`): ``W + scale * A @ B`` per projection gives a plain model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import DTypeLike

from jaxlab.config.schema import ModelConfig

Array = jax.Array
#: ``{projection: {"a": [L, N, in, R], "b": [L, N, R, out]}}`` (one layer: no ``L``).
Weights = dict[str, dict[str, Array]]

#: ``train.lora.targets`` -> the adapted projections.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "q": ("q",),
    "k": ("k",),
    "v": ("v",),
    "o": ("o",),
    "mlp": ("mlp_in", "mlp_down"),
}
#: The adapter id of "no adapter": :func:`stack` makes slot 0 all zeros.
NO_ADAPTER = 0
#: Dropout streams: one per projection, folded into the layer's key.
_STREAM = {name: i for i, name in enumerate(("q", "k", "v", "o", "mlp_in", "mlp_down"))}


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every projection an adapter can sit on."""
    h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    width = 2 * cfg.d_mlp if cfg.mlp == "swiglu" else cfg.d_mlp
    return {
        "q": (cfg.d_model, h * d),
        "k": (cfg.d_model, kv * d),
        "v": (cfg.d_model, kv * d),
        "o": (h * d, cfg.d_model),
        "mlp_in": (cfg.d_model, width),
        "mlp_down": (cfg.d_mlp, cfg.d_model),
    }


def qkv_columns(cfg: ModelConfig) -> dict[str, slice]:
    """Where ``q``, ``k`` and ``v`` sit among the fused ``w_qkv``'s columns."""
    h, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return {"q": slice(0, h * d), "k": slice(h * d, (h + kv) * d), "v": slice((h + kv) * d, None)}


def projections(targets: Sequence[str]) -> tuple[str, ...]:
    """The projections ``targets`` adapt, in a fixed order."""
    wanted = {p for t in targets for p in PROJECTIONS[t]}
    return tuple(p for p in _STREAM if p in wanted)


def init_weights(cfg: ModelConfig, rank: int, targets: Sequence[str], key: Array) -> Weights:
    """One fresh adapter (``N = 1``): ``A ~ N(0, 1/in)``, ``B = 0``, all float32."""
    shapes = projection_shapes(cfg)
    out: Weights = {}
    for i, name in enumerate(projections(targets)):
        n_in, n_out = shapes[name]
        a = jax.random.normal(jax.random.fold_in(key, i), (cfg.n_layers, 1, n_in, rank))
        out[name] = {
            "a": a * (1.0 / math.sqrt(n_in)),
            "b": jnp.zeros((cfg.n_layers, 1, rank, n_out), jnp.float32),
        }
    return out


def scale_of(alpha: float, rank: int) -> float:
    return alpha / rank


@struct.dataclass
class Lora:
    """The adapters of one forward call (see the module docstring).

    ``weights`` hold a layer axis at the model level and none once :meth:`layer` took one
    layer's slice. ``ids int32[B]`` picks each row's adapter (None: slot 0 for every row,
    no gather). ``dropout_key`` turns dropout of rate ``dropout_rate`` on the adapters'
    input on (training only).
    """

    weights: Weights
    scale: Array
    ids: Array | None = None
    dropout_key: Array | None = None
    dropout_rate: float = struct.field(pytree_node=False, default=0.0)

    @classmethod
    def single(
        cls,
        weights: Weights,
        scale: float,
        *,
        dropout_key: Array | None = None,
        dropout_rate: float = 0.0,
    ) -> Lora:
        """One adapter (``N = 1``) for every row: a training run's."""
        return cls(weights, jnp.full((1,), scale, jnp.float32), None, dropout_key, dropout_rate)

    def layer(self, i: int | Array) -> Lora:
        """Layer ``i``'s adapters, with layer ``i``'s dropout key."""
        return self.with_layer(jax.tree.map(lambda w: w[i], self.weights), i)

    def with_layer(self, weights: Weights, i: int | Array) -> Lora:
        """These adapters with one layer's ``weights`` (a scan's slice) and its key."""
        key = None if self.dropout_key is None else jax.random.fold_in(self.dropout_key, i)
        return dataclasses.replace(self, weights=weights, dropout_key=key)

    def take(self, r: int) -> Lora:
        """The adapters of the leading ``r`` rows (a row bucket)."""
        return self if self.ids is None else dataclasses.replace(self, ids=self.ids[:r])

    def delta(self, name: str, x: Array, compute_dtype: DTypeLike) -> Array | None:
        """``(dropout(x) @ A @ B) * scale`` of projection ``name`` for ``x [B, T, in]``,
        each row with its adapter: f32 ``[B, T, out]``; None when ``name`` has none."""
        w = self.weights.get(name)
        if w is None:
            return None
        if self.dropout_key is not None and self.dropout_rate > 0.0:
            keep = 1.0 - self.dropout_rate
            key = jax.random.fold_in(self.dropout_key, _STREAM[name])
            mask = jax.random.bernoulli(key, keep, x.shape)
            x = jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))
        return low_rank(x, w["a"], w["b"], self.scale, self.ids, compute_dtype)


def low_rank(
    x: Array, a: Array, b: Array, scale: Array, ids: Array | None, compute_dtype: DTypeLike
) -> Array:
    """``(x @ A[id] @ B[id]) * scale[id]`` per row: f32 ``[B, T, out]``.

    ``x [B, T, in]``, ``a [N, in, R]``, ``b [N, R, out]``, ``scale f32[N]``, ``ids
    int32[B]`` or None (slot 0 for every row: two plain 2-D matmuls, no gather).
    """
    cd = compute_dtype
    if ids is None:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(cd)
        u = jnp.matmul(x2, a[0].astype(cd), preferred_element_type=jnp.float32)
        y = jnp.matmul(u.astype(cd), b[0].astype(cd), preferred_element_type=jnp.float32)
        return (y * scale[0]).reshape(*lead, b.shape[-1])
    a_rows, b_rows = a[ids].astype(cd), b[ids].astype(cd)  # [B, in, R], [B, R, out]
    u = jnp.einsum("bti,bir->btr", x.astype(cd), a_rows, preferred_element_type=jnp.float32)
    y = jnp.einsum("btr,bro->bto", u.astype(cd), b_rows, preferred_element_type=jnp.float32)
    return y * scale[ids][:, None, None]


def add_qkv(
    qkv: Array, x: Array, lora: Lora | None, compute_dtype: DTypeLike, q_width: int, kv_width: int
) -> Array:
    """The fused ``qkv [B, T, q_width + 2 kv_width]`` plus the ``q``/``k``/``v`` adapters'
    deltas in their columns (``x``: the projection's input)."""
    if lora is None:
        return qkv
    widths = {"q": q_width, "k": kv_width, "v": kv_width}
    deltas = {n: lora.delta(n, x, compute_dtype) for n in widths}
    if all(d is None for d in deltas.values()):
        return qkv
    # One add of the three deltas side by side (zeros where a target has no adapter), which
    # XLA can fuse with the concatenation, rather than one column update per target.
    parts = [
        jnp.zeros((*qkv.shape[:-1], widths[n]), jnp.float32) if d is None else d
        for n, d in deltas.items()
    ]
    return qkv + jnp.concatenate(parts, axis=-1).astype(qkv.dtype)


def add(y: Array, name: str, x: Array, lora: Lora | None, compute_dtype: DTypeLike) -> Array:
    """``y`` (projection ``name``'s output for input ``x``) plus its adapter's delta."""
    d = None if lora is None else lora.delta(name, x, compute_dtype)
    return y if d is None else y + d.astype(y.dtype)


def pad_rank(weights: Weights, rank: int) -> Weights:
    """The same adapter at a larger ``rank``: zero columns of ``A``, zero rows of ``B``
    (the product is unchanged, exactly)."""

    def one(w: dict[str, Array]) -> dict[str, Array]:
        extra = rank - w["a"].shape[-1]
        return {
            "a": jnp.pad(w["a"], [(0, 0)] * (w["a"].ndim - 1) + [(0, extra)]),
            "b": jnp.pad(w["b"], [(0, 0)] * (w["b"].ndim - 2) + [(0, extra), (0, 0)]),
        }

    return {name: one(w) for name, w in weights.items()}


def stack(cfg: ModelConfig, adapters: Sequence[tuple[Weights, float]]) -> tuple[Weights, Array]:
    """Several single adapters (``(weights, scale)``, each ``N = 1``) as one :class:`Lora`'s
    ``(weights [L, 1 + n, in, R], scale f32[1 + n])``: slot :data:`NO_ADAPTER` all zeros,
    adapter ``i`` in slot ``i + 1``. Ranks are padded to the largest; a projection some
    adapters lack is zero for them."""
    shapes = projection_shapes(cfg)
    names = [p for p in _STREAM if any(p in w for w, _ in adapters)]
    rank = max((w[n]["a"].shape[-1] for w, _ in adapters for n in w), default=1)

    def slot(w: Weights | None, name: str) -> dict[str, Array]:
        if w is not None and name in w:
            return pad_rank({name: w[name]}, rank)[name]
        n_in, n_out = shapes[name]
        return {
            "a": jnp.zeros((cfg.n_layers, 1, n_in, rank), jnp.float32),
            "b": jnp.zeros((cfg.n_layers, 1, rank, n_out), jnp.float32),
        }

    out: Weights = {}
    for name in names:
        slots = [slot(None, name)] + [slot(w, name) for w, _ in adapters]
        out[name] = {
            k: jnp.concatenate([s[k].astype(jnp.float32) for s in slots], axis=1)
            for k in ("a", "b")
        }
    scale = jnp.asarray([0.0] + [s for _, s in adapters], jnp.float32)
    return out, scale


def weight_delta(w: Mapping[str, Array], scale: float) -> Array:
    """``scale * A @ B`` of one adapter in slot 0: f32 ``[L, in, out]``."""
    return scale * jnp.einsum(
        "lir,lro->lio", w["a"][:, 0], w["b"][:, 0], precision=jax.lax.Precision.HIGHEST
    )


def merge(cfg: ModelConfig, params: Any, weights: Weights, scale: float) -> Any:
    """Base ``params`` (a pure dict, :func:`flax.nnx.to_pure_dict`) with one adapter folded
    in: every adapted kernel becomes ``W + scale * A @ B`` (summed in f32, stored in the
    kernel's dtype). ``params`` is updated in place and returned. Works on unrolled and
    stacked (``scan_layers``) parameters."""
    deltas = {name: weight_delta(w, scale) for name, w in weights.items()}
    cols = qkv_columns(cfg)
    blocks = params["blocks"]
    stacked = "stacked" in blocks

    def layer_params(i: int) -> Any:
        # A checkpoint read without a target keys the blocks "0", "1", ...
        return blocks["stacked"] if stacked else blocks[i if i in blocks else str(i)]

    def fold(holder: dict[str, Any], key: str, i: int, d: Array, cols: slice | None) -> None:
        w = holder[key]
        w32 = jnp.asarray(w).astype(jnp.float32)
        idx = (i,) if stacked else ()
        region = (*idx, slice(None), cols if cols is not None else slice(None))
        holder[key] = w32.at[region].add(d[i]).astype(jnp.asarray(w).dtype)

    where = {
        "q": ("attn", "w_qkv", cols["q"]),
        "k": ("attn", "w_qkv", cols["k"]),
        "v": ("attn", "w_qkv", cols["v"]),
        "o": ("attn", "w_out", None),
        "mlp_in": ("mlp", "w_in", None),
        "mlp_down": ("mlp", "w_down", None),
    }
    for name, d in deltas.items():
        module, key, c = where[name]
        for i in range(cfg.n_layers):
            fold(layer_params(i)[module], key, i, d, c)
    return params


__all__ = [
    "NO_ADAPTER",
    "PROJECTIONS",
    "Lora",
    "Weights",
    "add",
    "add_qkv",
    "init_weights",
    "low_rank",
    "merge",
    "pad_rank",
    "projection_shapes",
    "projections",
    "qkv_columns",
    "scale_of",
    "stack",
]
