"""Choose the JAX platform before jax is imported.

JAX reads ``JAX_PLATFORMS`` once, when its backends initialise, so forcing the CPU
(``--cpu``, ``runtime.platform = "cpu"``) must happen before the first ``import jax``
touches a backend. Calling this after backends exist still updates ``jax.config``,
which is honoured as long as no computation ran yet.
"""

from __future__ import annotations

import os
import sys

_JAX_NAMES = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def configure_platform(platform: str) -> None:
    """Pin JAX to ``platform`` ('auto' leaves JAX's own choice alone)."""
    if platform == "auto":
        return
    name = _JAX_NAMES[platform]
    os.environ["JAX_PLATFORMS"] = name
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_platforms", name)
