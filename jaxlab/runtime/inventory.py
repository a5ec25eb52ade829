"""What this process runs on: versions, devices, CPU, XLA flags, git state.

Used by ``jaxlab devices``, run manifests and benchmark records, so every record says
where it was measured.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tiktoken", "numpy")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    try:
        out["jaxlab"] = importlib.metadata.version("jaxlab")
    except importlib.metadata.PackageNotFoundError:
        out["jaxlab"] = "source"
    return out


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: str | None = None) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line whose key starts with one of ``names``
    (``cpuinfo``: that file's text, default: read it); None where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith(names):
            return line.split(":", 1)[1].strip()
    return None


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``), or ``""`` if unknown."""
    return _cpuinfo_field(("vendor_id",)) or ""


def cpu_model() -> str:
    model = _cpuinfo_field(("model name",))
    return model if model is not None else platform.processor() or platform.machine()


#: Widest first, with the name each is recorded under: what decides an f32 matmul's peak on
#: a CPU, and what two VMs that report the same ``model name`` ("AMD EPYC") can differ in.
_SIMD_LEVELS = (
    ("avx512f", "avx512f"),
    ("avx2", "avx2"),
    ("avx", "avx"),
    ("sve", "sve"),
    ("asimd", "neon"),
    ("neon", "neon"),
)


def cpu_simd(cpuinfo: str | None = None) -> str | None:
    """The CPU's widest vector extension (``avx512f``, ``avx2``, ``avx``; ``sve`` or ``neon``
    on Arm), or None where ``/proc/cpuinfo`` names none. Cloud VMs often report only a
    vendor's family name as ``model name``, so this is what tells, say, an AVX-512 VM from an
    AVX2 one in a benchmark record. ``cpuinfo``: that file's text (default: read it)."""
    flags = set((_cpuinfo_field(("flags", "Features"), cpuinfo) or "").split())
    return next((name for flag, name in _SIMD_LEVELS if flag in flags), None)


def device_inventory() -> dict[str, Any]:
    """Backend, devices and memory as JAX sees them (imports jax)."""
    import jax

    devices = jax.devices()
    local = jax.local_devices()
    first = devices[0]

    def describe(d: Any) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": d.id,
            "platform": d.platform,
            "kind": d.device_kind,
            "process_index": d.process_index,
        }
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats:
            info["memory"] = {
                k: stats[k]
                for k in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use")
                if k in stats
            }
        return info

    return {
        "backend": jax.default_backend(),
        "platform": first.platform,
        "device_kind": first.device_kind,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": [describe(d) for d in local],
        "cpu_model": cpu_model(),
        "cpu_vendor": cpu_vendor(),
        "cpu_simd": cpu_simd(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
        "versions": versions(),
    }


def git_state(path: Path | None = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout holding ``path`` (None outside a checkout)."""
    cwd = str(path or Path.cwd())
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def python_info() -> dict[str, str]:
    return {"executable": sys.executable, "version": sys.version.split()[0]}
