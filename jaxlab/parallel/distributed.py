"""Joining JAX's multi-controller runtime, before any computation runs.

Every process runs the same program; ``jax.devices()`` then lists all processes'
devices, a mesh spans them, and each process feeds only its own rows of every batch.
On CPU the cross-process collectives go through gloo over TCP (loopback locally).
"""

from __future__ import annotations

import logging
from typing import Any

from jaxlab.config.schema import RuntimeConfig

log = logging.getLogger("jaxlab.distributed")
_initialized = False


def initialize(runtime: RuntimeConfig) -> bool:
    """Call ``jax.distributed.initialize`` as configured; True if this is a multi-process run."""
    global _initialized
    d = runtime.distributed
    if d.mode == "off" or _initialized:
        return _initialized
    import jax

    if d.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": d.heartbeat_timeout_s}
    if d.mode == "manual":
        kwargs.update(
            coordinator_address=d.coordinator_address,
            num_processes=d.num_processes,
            process_id=d.process_id,
            initialization_timeout=120,
        )
    jax.distributed.initialize(**kwargs)  # type: ignore[arg-type]
    _initialized = True
    log.info("process %d of %d joined", jax.process_index(), jax.process_count())
    return True


def is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """All processes reach this point before any continues (no-op on one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
