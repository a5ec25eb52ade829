"""cpu_simd: the widest vector extension named in /proc/cpuinfo, what tells two VMs that
share a ``model name`` apart in a benchmark record."""

from __future__ import annotations

import pytest

from jaxlab.runtime import cpu_simd

ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
ZEN4 = "model name\t: AMD EPYC\nflags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16\n"


@pytest.mark.parametrize(
    ("cpuinfo", "simd"),
    [
        (ZEN3, "avx2"),
        (ZEN4, "avx512f"),
        ("flags\t\t: fpu sse2 avx\n", "avx"),
        ("flags\t\t: fpu sse2\n", None),
        ("Features\t: fp asimd evtstrm sve\n", "sve"),
        ("Features\t: fp asimd evtstrm\n", "neon"),
        ("model name\t: no flags line\n", None),
    ],
)
def test_the_widest_extension_is_named(cpuinfo, simd):
    assert cpu_simd(cpuinfo) == simd


def test_this_machine_gives_a_name_or_none():
    assert cpu_simd() in (None, "avx512f", "avx2", "avx", "sve", "neon")
