"""Choose the JAX platform, and jaxlab's XLA:CPU flag defaults, before jax starts a backend.

JAX reads ``JAX_PLATFORMS`` once, when its backends initialise, so forcing the CPU
(``--cpu``, ``runtime.platform = "cpu"``) must happen before the first ``import jax``
touches a backend. Calling this after backends exist still updates ``jax.config``,
which is honoured as long as no computation ran yet.

``XLA_FLAGS`` is likewise read once, when the first backend starts. For the CPU (and
``auto``) platform jaxlab adds to it the flags :func:`xla_cpu_defaults` gives for this
CPU's vendor - each one only when the user's ``XLA_FLAGS`` does not already name that
flag, never once a backend exists, and not at all with ``JAXLAB_XLA_CPU_DEFAULTS=0``. See
``docs/performance.md`` for the measurements behind them.

The config's own flags, ``runtime.xla_flags`` and ``runtime.libtpu_init_args`` (the TPU
compiler's and runtime's, read from ``LIBTPU_INIT_ARGS``), are appended to their variables
the same way by :func:`apply_flag_config`, before anything starts a backend.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from jaxlab.runtime.inventory import cpu_vendor

if TYPE_CHECKING:
    from jaxlab.config.schema import RuntimeConfig

_JAX_NAMES = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}

#: The XLA:CPU flags jaxlab sets by default (``--name=value``), by CPU vendor, with the
#: reason for each. Both choices are about one flag, which decides which ops XLA:CPU (jaxlib
#: 0.10) hands to the YNNPACK library; by default it hands dots *and* the reductions they
#: feed. Numerics semantics are the same under every setting (no fast-math, f32 stays f32,
#: default matmul precision): only which kernel runs a dot or a reduction, that is, the f32
#: summation order. Figures in ``docs/performance.md``.
#:
#: * ``AuthenticAMD``: ``individual_dot``, so YNNPACK keeps the dots and loses the
#:   reductions. On the AMD VM its reductions slowed the train step, and its dots sped up
#:   the memory-bound decode step with the train step unchanged.
#: * ``GenuineIntel``: the empty list, so XLA's own kernels run every op. On the Intel VM
#:   its dots sped up the decode step at 8 and 16 rows and left batch 1 and the train step
#:   unchanged.
#: * Any other vendor, or none found: the AMD choice, the one measured longest.
XLA_CPU_DEFAULTS_BY_VENDOR: dict[str, dict[str, str]] = {
    "AuthenticAMD": {"xla_cpu_experimental_ynn_fusion_type": "individual_dot"},
    "GenuineIntel": {"xla_cpu_experimental_ynn_fusion_type": ""},
}
_OTHER_VENDOR = "AuthenticAMD"


def xla_cpu_defaults(vendor: str | None = None) -> dict[str, str]:
    """jaxlab's XLA:CPU flag defaults for ``vendor`` (default: this machine's ``vendor_id``)."""
    vendor = cpu_vendor() if vendor is None else vendor
    return XLA_CPU_DEFAULTS_BY_VENDOR.get(vendor, XLA_CPU_DEFAULTS_BY_VENDOR[_OTHER_VENDOR])


#: Set to ``0`` to keep ``XLA_FLAGS`` exactly as given.
OPT_OUT_ENV = "JAXLAB_XLA_CPU_DEFAULTS"


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API moved: assume the worst, leave the flags alone
        return True


def xla_cpu_default_flags(xla_flags: str, vendor: str | None = None) -> list[str]:
    """The ``--flag=value`` entries of :func:`xla_cpu_defaults` that ``xla_flags`` lacks."""
    given = {tok.lstrip("-").split("=", 1)[0] for tok in xla_flags.split() if tok.startswith("--")}
    defaults = xla_cpu_defaults(vendor)
    return [f"--{name}={value}" for name, value in defaults.items() if name not in given]


def apply_xla_cpu_defaults(
    environ: MutableMapping[str, str] | None = None, vendor: str | None = None
) -> list[str]:
    """Append jaxlab's XLA:CPU defaults for ``vendor`` (default: this machine's) to
    ``XLA_FLAGS``; returns the flags added.

    Adds nothing when the user already names a flag, when ``JAXLAB_XLA_CPU_DEFAULTS=0``,
    or when a JAX backend has already started (the flags would be ignored, silently).
    """
    env = os.environ if environ is None else environ
    if env.get(OPT_OUT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    if environ is None and _backends_started():
        return []
    current = env.get("XLA_FLAGS", "")
    added = xla_cpu_default_flags(current, vendor)
    if added:
        env["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def _flag_names(value: str) -> set[str]:
    return {tok.lstrip("-").split("=", 1)[0] for tok in value.split() if tok.startswith("--")}


#: The environment variable each flag list of ``runtime`` goes to.
FLAG_VARIABLES = {"xla_flags": "XLA_FLAGS", "libtpu_init_args": "LIBTPU_INIT_ARGS"}


def apply_flag_config(
    runtime: RuntimeConfig, environ: MutableMapping[str, str] | None = None
) -> dict[str, list[str]]:
    """Append ``runtime.xla_flags`` to ``XLA_FLAGS`` and ``runtime.libtpu_init_args`` to
    ``LIBTPU_INIT_ARGS``; returns the flags added, by variable.

    A flag the variable already names keeps the variable's value (logged: the environment
    is the caller's own word). Raises ``RuntimeError`` when there are flags to set and a
    JAX backend has already started: XLA would ignore them, silently.
    """
    env = os.environ if environ is None else environ
    wanted = {var: list(getattr(runtime, field)) for field, var in FLAG_VARIABLES.items()}
    if not any(wanted.values()):
        return {var: [] for var in wanted}
    if environ is None and _backends_started():
        raise RuntimeError(
            "runtime.xla_flags / runtime.libtpu_init_args must be set before JAX starts a "
            "backend (XLA reads them once per process)"
        )
    added: dict[str, list[str]] = {}
    for var, flags in wanted.items():
        current = env.get(var, "")
        given = _flag_names(current)
        new = [f for f in flags if f.lstrip("-").split("=", 1)[0] not in given]
        kept = [f for f in flags if f not in new]
        if kept:
            logging.getLogger("jaxlab.runtime").warning(
                "%s already names %s: the variable's value stays", var, ", ".join(kept)
            )
        if new:
            env[var] = " ".join([current, *new]).strip()
        added[var] = new
    return added


def configure_platform(platform: str) -> None:
    """Pin JAX to ``platform`` ('auto' leaves JAX's own choice alone).

    For ``cpu`` and ``auto`` also applies :func:`xla_cpu_defaults`
    (:func:`apply_xla_cpu_defaults`).
    """
    if platform in ("cpu", "auto"):
        apply_xla_cpu_defaults()
    if platform == "auto":
        return
    name = _JAX_NAMES[platform]
    os.environ["JAX_PLATFORMS"] = name
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_platforms", name)


def enable_compilation_cache(path: str | os.PathLike[str] | None) -> Path | None:
    """Turn on JAX's persistent compilation cache in ``path`` (``None``: leave it as it is).

    Every executable is cached, however quick its compile: JAX's default skips those under
    a second, a serve warm-up has dozens near that threshold, and a cache hit is a file read
    (warm-up times in docs/performance.md). The cache key is JAX's own: the HLO, the compile
    options and flags, the backend and jaxlib versions, so a changed model, shape, flag or
    jaxlib compiles afresh. Call it before the first compile of the process; JAX decides
    once whether a cache is in use. Returns the directory (created if missing).
    """
    if path is None or str(path) == "":
        return None
    import jax

    where = Path(path).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where


def configure_runtime(runtime: RuntimeConfig) -> None:
    """What a command that runs the model sets up from ``runtime`` before anything
    compiles: the platform (:func:`configure_platform`), the config's XLA flags
    (:func:`apply_flag_config`) and the persistent compilation cache
    (:func:`enable_compilation_cache`). ``jaxlab bench`` calls only the first two."""
    configure_platform(runtime.platform)
    apply_flag_config(runtime)
    enable_compilation_cache(runtime.compilation_cache_dir)
