"""Logical axis names for every parameter, and the rules that map them onto the mesh.

As in MaxText and levanter, parameters are described by *logical* axes (``embed``,
``heads``, ``mlp``, ``vocab``) and a rules table decides which mesh axis each one is split
over. DP, FSDP and TP are then just different mesh shapes for the same rules:

- ``embed -> fsdp``: FSDP shards every kernel (and, by propagation, its AdamW moments)
  along ``d_model``; with ``fsdp = 1`` that is plain replication (DP).
- ``qkv / heads / mlp / vocab -> tensor``: Megatron-style TP splits the attention
  projections, the MLP hidden dimension and the vocabulary over ``tensor``.

The partitioner (GSPMD) inserts the all-gathers and reduce-scatters these shardings imply;
results equal the single-device computation up to f32 reduction order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxlab.config.schema import ModelConfig
from jaxlab.parallel.mesh import MeshError

# logical axis -> mesh axis (None = replicated)
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "qkv": "tensor",
    "heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "norm": None,
    "position": None,
    "layers": None,  # the leading axis of stacked blocks (model.scan_layers): never split
}

# parameter name (last path component) -> logical axes, by the model's layout
_PARAM_AXES: dict[str, tuple[str, ...]] = {
    "w_qkv": ("embed", "qkv"),
    "w_out": ("heads", "embed"),
    "w_in": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "scale": ("norm",),
    "lm_head": ("embed", "vocab"),
}

# which config field a logical axis comes from, for error messages
_FIELD = {
    "embed": "model.d_model",
    "qkv": "model.n_heads/n_kv_heads (the fused q,k,v width (n_heads + 2*n_kv_heads)*head_dim)",
    "heads": "model.n_heads (n_heads*head_dim)",
    "mlp": "model.d_mlp",
    "vocab": "model.vocab_size",
}


def _names(path: tuple[Any, ...]) -> list[str]:
    out = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        out.append(str(name))
    return [n for n in out if n != "value"]


def logical_axes(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[str | None, ...]:
    names = _names(path)
    if "table" in names:
        return ("position", "embed") if any("pos" in n for n in names) else ("vocab", "embed")
    for n in reversed(names):
        if n in _PARAM_AXES:
            axes = _PARAM_AXES[n]
            if len(axes) == len(shape):
                return axes
            if len(axes) + 1 == len(shape) and "blocks" in names:
                return ("layers", *axes)  # stacked blocks (model.scan_layers)
    return (None,) * len(shape)


def spec_for(
    axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    mesh: Any,
    rules: Mapping[str, Any] = DEFAULT_RULES,
    where: str = "",
) -> Any:
    from jax.sharding import PartitionSpec

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    parts = []
    for axis, dim in zip(axes, shape, strict=True):
        mesh_axis = rules.get(axis) if axis else None
        group = (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis or ())
        n = int(np.prod([sizes[a] for a in group])) if group else 1
        if n > 1 and dim % n:
            field = _FIELD.get(axis or "", axis)
            raise MeshError(
                f"parallel.{'*'.join(group)}={n} does not divide {field} (dimension {dim} of "
                f"{where or 'a parameter'}); choose a mesh axis size that divides {dim}"
            )
        parts.append(None if n == 1 else (group[0] if len(group) == 1 else group))
    return PartitionSpec(*parts)


def param_shardings(params: Any, mesh: Any, rules: Mapping[str, Any] = DEFAULT_RULES) -> Any:
    """A NamedSharding for every parameter leaf, from its logical axes."""
    import jax
    from jax.sharding import NamedSharding

    def one(path: tuple[Any, ...], leaf: Any) -> Any:
        shape = tuple(leaf.shape)
        where = "/".join(_names(path))
        return NamedSharding(mesh, spec_for(logical_axes(path, shape), shape, mesh, rules, where))

    return jax.tree_util.tree_map_with_path(one, params)


def state_shardings(params: Any, tx: Any, mesh: Any, *, master: bool = False) -> dict[str, Any]:
    """Shardings of the whole train state: AdamW moments (and ``master`` weights, when the
    state has them) follow their parameters."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())
    p_shard = param_shardings(params, mesh)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shard = optax.tree_map_params(
        tx,
        lambda _, s: s,
        opt_shapes,
        p_shard,
        transform_non_params=lambda _: replicated,
    )
    out = {
        "params": p_shard,
        "opt_state": opt_shard,
        "step": replicated,
        "rng": replicated,
        "skipped": replicated,
        "bad_step": replicated,
    }
    if master:
        out["master"] = p_shard
    return out


def batch_sharding(mesh: Any, ndim: int = 2) -> Any:
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(DEFAULT_RULES["batch"], *([None] * (ndim - 1))))


def place_batch(local: Mapping[str, np.ndarray], mesh: Any) -> dict[str, Any]:
    """Global arrays sharded over (data, fsdp) from this process's rows of the batch."""
    import jax

    return {
        k: jax.make_array_from_process_local_data(batch_sharding(mesh, v.ndim), np.asarray(v))
        for k, v in local.items()
    }


def check_model_fits(cfg: ModelConfig, mesh: Any) -> None:
    """Raise MeshError naming the dimension a mesh axis does not divide (no allocation)."""
    from flax import nnx

    from jaxlab.config.schema import PrecisionConfig
    from jaxlab.model import make_model

    tensor = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)).get("tensor", 1)
    if cfg.n_heads % tensor:
        raise MeshError(
            f"parallel.tensor={tensor} does not divide model.n_heads={cfg.n_heads}: tensor "
            "parallelism splits whole attention heads; use a tensor size that divides n_heads"
        )
    abstract = nnx.eval_shape(lambda: make_model(cfg, PrecisionConfig(), 0))
    param_shardings(nnx.state(abstract, nnx.Param), mesh)
