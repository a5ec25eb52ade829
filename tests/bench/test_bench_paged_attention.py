"""The ``paged-attention`` suite's plan: which kernels it measures where, its inputs and the
bytes it counts. The suite itself runs on the chip (``docs/kernels.md``); these check its
pure parts here."""

from __future__ import annotations

import numpy as np

from jaxlab.bench.paged_attention_suite import candidates, inputs, kv_bytes
from jaxlab.bench.suites import load_builtin_suites

SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 8, "page_size": 16, "dtype": "bfloat16"}


def kernels_of(
    backend: str, quick: bool, width: int = 32, sweep: bool = True
) -> list[tuple[str, str]]:
    cands = candidates(backend, quick, width, sweep)
    return [(case["kernel"], case["blocks"]) for case, _ in cands]


def test_the_pallas_kernels_run_on_the_tpu_only() -> None:
    assert kernels_of("cpu", quick=False) == [("paged_xla", "-")]
    assert kernels_of("tpu", quick=True) == [
        ("paged_xla", "-"),
        ("paged_pallas", "default"),
        ("jax_paged", "pages_per_block=8"),
    ]
    full = kernels_of("tpu", quick=False)
    pallas = [b for k, b in full if k == "paged_pallas"]
    assert pallas[0] == "default" and len(pallas) == 7
    assert [b for k, b in full if k == "jax_paged"] == ["pages_per_block=8", "pages_per_block=16"]
    plain = kernels_of("tpu", quick=False, sweep=False)  # below the largest batch
    assert [b for k, b in plain if k == "paged_pallas"] == ["default"]
    # jax's kernel needs its block to divide the table: 40 pages take 8, not 16.
    assert [b for k, b in kernels_of("tpu", False, 40) if k == "jax_paged"] == ["pages_per_block=8"]


def test_inputs_scatter_each_rows_pages_and_count_the_bytes_it_must_read() -> None:
    q, layer, positions, jax_table, lengths = inputs(4, 100, True, SHAPE, seed=3)
    table, num_pages = np.asarray(layer.table), layer.num_pages
    assert q.shape == (4, 1, 4, 8) and layer.k.shape == (2, num_pages, 16, 8)
    assert str(q.dtype) == str(layer.k.dtype) == "bfloat16"
    assert table.shape == (4, 7) and num_pages == 4 * 7 + 8
    np.testing.assert_array_equal(np.asarray(positions)[:, 0], lengths - 1)
    assert ((lengths >= 1) & (lengths <= 100)).all()
    real = table[table < num_pages]
    assert len(set(real.tolist())) == len(real)  # no page is held twice
    for b, n in enumerate(lengths):  # a row's pages for its length, then NO_PAGE
        held = -(-int(n) // 16)
        assert (table[b, :held] < num_pages).all() and (table[b, held:] == num_pages).all()
    assert (np.asarray(jax_table) < num_pages).all()
    assert kv_bytes(lengths, 2, 8, 2) == 2 * 2 * 8 * 2 * int(lengths.sum())
    _, full, _, _, full_lengths = inputs(2, 64, False, SHAPE, seed=0)
    assert (full_lengths == 64).all() and (np.asarray(full.table) < full.num_pages).all()


def test_the_suite_is_registered_but_not_run_by_default() -> None:
    spec = load_builtin_suites()["paged-attention"]
    assert spec.needs_peak and not spec.default


def test_the_tpu_smoke_script_checks_a_shape_and_says_so() -> None:
    """One small shape through the smoke script on the CPU (interpret mode): its line
    says PASS with the error and the bound. Every shape it checks on the chip runs the
    kernel there (none would fall back to paged_xla)."""
    from jaxlab.bench.tpu_kernel_smoke import SHAPES, Shape, check
    from jaxlab.kernels.paged_pallas import runs_pallas

    tiny = Shape(
        "tiny", batch=3, context=40, heads=4, kv_heads=2, head_dim=8, page_size=8,
        dtype="float32", ragged=True, blocks={"pages_per_block": 2, "rows_per_step": 2},
    )  # fmt: skip
    ok, line = check(tiny)
    assert ok and line.startswith("PASS tiny: max |diff|") and "on cpu" in line
    assert len({s.name for s in SHAPES}) == len(SHAPES)
    assert all(runs_pallas(1, s.page_size, s.dtype, "tpu", tpu=True) for s in SHAPES)


def test_the_tpu_smoke_script_checks_the_decode_write_and_says_so() -> None:
    from jaxlab.bench.tpu_kernel_smoke import WRITES, check_write

    ok, line = check_write("small write", 6, 16, "float32")
    assert ok and line.startswith("PASS small write: equal to the scatter") and "on cpu" in line
    assert len({w[0] for w in WRITES}) == len(WRITES)
