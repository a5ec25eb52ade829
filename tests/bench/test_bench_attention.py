"""The ``attention`` suite's plan: which kernels it measures where, its FLOPs and segments.

The suite itself runs on the chip (``docs/kernels.md``); these check its pure parts here.
"""

from __future__ import annotations

import numpy as np

from jaxlab.bench.kernel_suites import attention_flops, candidates, packed_segments
from jaxlab.bench.suites import load_builtin_suites


def kernels_of(backend: str, quick: bool, t: int = 1024) -> list[tuple[str, str]]:
    return [(case["kernel"], case["blocks"]) for case, _ in candidates(backend, quick, 4, t)]


def test_jax_tpu_kernels_are_left_out_off_the_tpu() -> None:
    assert kernels_of("cpu", quick=True) == [
        ("reference", "-"),
        ("xla", "-"),
        ("xla_cpu", "-"),
        ("pallas", "512x512"),
    ]
    on_tpu = kernels_of("tpu", quick=True)
    assert {"jax_flash", "jax_splash"} <= {k for k, _ in on_tpu}
    assert "xla_cpu" not in {k for k, _ in on_tpu}


def test_the_sweep_names_the_tiles_that_run() -> None:
    swept = [b for k, b in kernels_of("cpu", quick=False) if k == "pallas"]
    assert swept == ["512x512", "256x256", "512x1024", "1024x1024"]
    # a short sequence clamps every size to one tile: measured once, under its real size
    assert [b for k, b in kernels_of("cpu", quick=False, t=64) if k == "pallas"] == ["128x128"]


def test_flops_and_segments() -> None:
    assert attention_flops(2, 8, 3, 4, backward=False) == 2 * 2 * 3 * 64 * 4
    assert attention_flops(2, 8, 3, 4, backward=True) == 3 * attention_flops(
        2, 8, 3, 4, backward=False
    )
    ids = packed_segments(3, 256, seed=0)
    assert ids.shape == (3, 256) and (np.diff(ids, axis=1) >= 0).all()
    lengths = [np.bincount(row) for row in ids]
    assert all(len(n) > 1 and n[:-1].min() >= 256 // 8 for n in lengths)  # the last one may be cut


def test_the_suite_is_registered_but_not_run_by_default() -> None:
    spec = load_builtin_suites()["attention"]
    assert spec.needs_peak and not spec.default
