"""What a device's vendor says it can do: the one table of datasheet peaks.

MFU and bandwidth utilisation are reported against these where a device has an entry
(``docs/benchmarking.md``), with the peak measured in the same run beside them. Keys are
``jax.Device.device_kind`` as JAX reports it on that device; a figure is per chip (one JAX
device). A device without an entry (every CPU: no datasheet applies to a shared VM) is held
against the best peak measured in the run alone.

Only devices whose ``device_kind`` string has been read on the device itself are listed:
a guessed key would silently give the wrong denominator or none. To add one, run ``jaxlab
devices`` on it and copy its ``kind``; give the vendor's page as the source.

Importing this module does not import jax.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Datasheet:
    """A device's published peaks, per chip."""

    name: str
    #: Dense matmul peak in TFLOP/s by input dtype (jax dtype names). A dtype that is not
    #: listed has no datasheet figure (float32 on a TPU: it runs as bf16 passes).
    matmul_tflops: Mapping[str, float] = field(default_factory=dict)
    #: HBM bandwidth, GB/s (10^9 bytes).
    memory_gb_per_s: float | None = None
    source: str = ""

    def matmul_gflops(self, dtype: str) -> float | None:
        tflops = self.matmul_tflops.get(dtype)
        return None if tflops is None else tflops * 1e3

    def describe(self, dtype: str) -> str:
        """The denominator in words: ``"<name> datasheet, <dtype>: <peak> TFLOP/s"``."""
        return f"{self.name} datasheet, {dtype}: {self.matmul_tflops[dtype]:g} TFLOP/s"


#: ``device_kind`` -> datasheet.
DATASHEETS: dict[str, Datasheet] = {
    # ``jax.devices()[0].device_kind`` on a v5e chip (JAX 0.10, read on the chip).
    "TPU v5 lite": Datasheet(
        name="TPU v5e",
        matmul_tflops={"bfloat16": 197.0, "int8": 394.0},
        memory_gb_per_s=819.0,
        source="https://cloud.google.com/tpu/docs/v5e (per-chip figures)",
    ),
}


def datasheet_for(device_kind: str | None) -> Datasheet | None:
    """The datasheet of a ``device_kind``, or None (no datasheet applies or is known)."""
    return None if device_kind is None else DATASHEETS.get(device_kind)


__all__ = ["DATASHEETS", "Datasheet", "datasheet_for"]
