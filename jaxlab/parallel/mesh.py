"""Build the ``(data, fsdp, tensor)`` device mesh a config asks for."""

from __future__ import annotations

import math
from typing import Any

from jaxlab.config.loader import ConfigError
from jaxlab.config.schema import ParallelConfig

MESH_AXES = ("data", "fsdp", "tensor")


class MeshError(ConfigError):
    """A mesh the devices cannot form; the message names the field and the fix (exit 2)."""

    def __init__(self, message: str):
        super().__init__([message])


def mesh_shape(parallel: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Resolve -1 (fill) and check the product equals the device count."""
    sizes = {"data": parallel.data, "fsdp": parallel.fsdp, "tensor": parallel.tensor}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [k for k, v in sizes.items() if v == -1]
    if fill:
        if n_devices % fixed:
            raise MeshError(
                f"parallel.{fill[0]}: cannot fill the mesh: {n_devices} devices are not "
                f"divisible by the other axes' product {fixed}"
            )
        sizes[fill[0]] = n_devices // fixed
    total = math.prod(sizes.values())
    if total != n_devices:
        raise MeshError(
            f"parallel: mesh data*fsdp*tensor = {sizes['data']}*{sizes['fsdp']}*"
            f"{sizes['tensor']} = {total}, but there are {n_devices} devices; make the "
            f"product {n_devices} or set one axis to -1"
        )
    return sizes


def build_mesh(parallel: ParallelConfig, devices: Any = None) -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(parallel, len(devices))
    grid = np.asarray(devices).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(grid, MESH_AXES)


def describe_mesh(mesh: Any) -> dict[str, Any]:
    return {
        "axes": dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
        "devices": int(mesh.devices.size),
    }
