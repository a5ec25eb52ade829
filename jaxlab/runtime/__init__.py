"""Process-level runtime facts: platform selection, versions, device inventory.

Importing this package does not import jax; only the functions that need it do.
"""

from jaxlab.runtime.inventory import cpu_model, cpu_simd, device_inventory, git_state, versions
from jaxlab.runtime.platform import (
    apply_flag_config,
    configure_platform,
    configure_runtime,
    enable_compilation_cache,
)

__all__ = [
    "apply_flag_config",
    "configure_platform",
    "configure_runtime",
    "cpu_model",
    "cpu_simd",
    "device_inventory",
    "enable_compilation_cache",
    "git_state",
    "versions",
]
