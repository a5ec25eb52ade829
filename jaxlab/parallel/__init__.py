"""Sharding as a value: a named device mesh, logical-axis rules, and placement helpers.

One code path serves 1 device, N devices and N processes: the trainer always builds a
mesh (``(1, 1, 1)`` on one CPU), places parameters by logical-axis rules and batches by
``(data, fsdp)``, and lets XLA's SPMD partitioner insert the collectives.
"""

from jaxlab.parallel.mesh import MESH_AXES, MeshError, build_mesh, describe_mesh, mesh_shape
from jaxlab.parallel.rules import (
    DEFAULT_RULES,
    batch_sharding,
    check_model_fits,
    logical_axes,
    param_shardings,
    place_batch,
    spec_for,
    state_shardings,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshError",
    "batch_sharding",
    "build_mesh",
    "check_model_fits",
    "describe_mesh",
    "logical_axes",
    "mesh_shape",
    "param_shardings",
    "place_batch",
    "spec_for",
    "state_shardings",
]
