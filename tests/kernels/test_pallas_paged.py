"""The Pallas paged decode kernel equals ``paged_reference`` (CPU, Pallas interpret mode).

* The plan: pages per block (exact when asked, lane-dense and VMEM-capped when not), the
  padded shapes, the blocks a row walks, and which page sizes Mosaic can tile.
* Decode attention against ``paged_reference`` with hypothesis choosing each row's
  position (length 1, whole pages, every page, a done row's ``NO_SLOT``), the page table
  (shuffled across the pool, rows interleaved, spare pages, ``NO_PAGE`` tails, a missing
  page inside a row's length), over page sizes (aligned to TPU tiles or not), kv-head
  groupings (G = 1, 2, 4), block and step sizes (one block per row, several, one page per
  block; rows padded to whole steps; a last block computed over each width of its ladder;
  two, three and four buffer slots) and batch sizes; f32 and bf16.
* Whatever pages past a row's length hold never reaches its output; a row that sees
  nothing comes out as zeros; ``T > 1``, and a pool in the kv-head-major layout, go to
  ``paged_xla``.

The kernel reads its lane-dense pool (:mod:`jaxlab.kernels.paged_dense`): each case draws
a kv-head-major pool for the reference and hands the kernel the same pages converted.

Shapes are fixed per parametrisation (each is one interpret-mode compile), hypothesis
varies the data.

Tolerances: in f32 both sides differ in summation order only (as in test_paged.py). In
bf16 the kernel rounds the unnormalised probabilities (at most 1) to bf16 before the
second dot and its output at the end, each by at most ``u = 2^-8`` relative, so it is
compared with the same math in f32 on the same bf16 inputs, allowing ``4u`` of the
largest value (the flash kernel's bound, test_pallas_flash.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxlab.kernels import NO_SLOT, PAGED_FOR, PAGED_KERNELS
from jaxlab.kernels import paged as pg
from jaxlab.kernels.paged_dense import from_head_major
from jaxlab.kernels.paged_pallas import CHIP_VALIDATED, PagedPallas, runs_pallas
from jaxlab.kernels.paged_plan import (
    VMEM_BUFFER_BYTES,
    PagedBlocks,
    make_plan,
    mosaic_problem,
    pages_per_block,
)

SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
D, MAX_LEN = 8, 48
BF16_U = 2.0**-8
REFERENCE = PAGED_KERNELS["paged_reference"]


# ------------------------------------------------------------------------ the plan


def test_pages_per_block_is_exact_when_asked_and_lane_dense_otherwise() -> None:
    at = functools.partial(pages_per_block, n_kv_heads=12, head_dim=64, itemsize=2)
    assert at(PagedBlocks(pages_per_block=3), page_size=16, max_pages=64) == 3
    assert at(PagedBlocks(), page_size=16, max_pages=64) == 32  # 512 tokens
    assert at(PagedBlocks(block_tokens=100), page_size=16, max_pages=64) == 8  # up to 128
    assert at(PagedBlocks(), page_size=16, max_pages=3) == 8  # one block: 48 -> 128 lanes
    assert at(PagedBlocks(block_tokens=100), page_size=48, max_pages=64) == 3  # 48 / 128: as is
    # VMEM: two slots of K and V of 12 heads of 64 (768 lanes, lane-dense) in f32 hold 682
    # tokens, 42 pages: rounded down to whole lanes, 40.
    per_token = 4 * 12 * 64 * 4
    assert 42 * 16 * per_token <= VMEM_BUFFER_BYTES < 43 * 16 * per_token
    assert at(PagedBlocks(block_tokens=4096), page_size=16, max_pages=256, itemsize=4) == 40
    # Four slots instead of two: half the tokens, 341, 21 pages, rounded down to 16.
    four = PagedBlocks(block_tokens=4096, slots=4)
    assert at(four, page_size=16, max_pages=256, itemsize=4) == 16
    assert at(PagedBlocks(block_tokens=4096), page_size=4096, max_pages=2, itemsize=4) == 1


def test_the_plan_pads_rows_heads_and_the_table() -> None:
    plan = make_plan(
        PagedBlocks(pages_per_block=4, rows_per_step=8),
        batch=5,
        max_pages=10,
        page_size=16,
        n_heads=12,
        n_kv_heads=4,
        head_dim=64,
        q_dtype=jnp.bfloat16,
        pool_dtype=jnp.bfloat16,
    )
    assert (plan.rows_per_step, plan.padded_batch, plan.steps) == (5, 5, 1)  # clamped
    assert (plan.heads, plan.heads_padded) == (12, 16)  # a bf16 tile is 16 rows
    assert (plan.block_tokens, plan.table_width, plan.max_tokens) == (64, 12, 160)
    f32 = make_plan(
        PagedBlocks(rows_per_step=2),
        batch=5,
        max_pages=10,
        page_size=16,
        n_heads=4,
        n_kv_heads=4,
        head_dim=64,
        q_dtype=jnp.float32,
        pool_dtype=jnp.float32,
    )
    assert (f32.padded_batch, f32.steps, f32.heads_padded) == (6, 3, 8)


def test_a_rows_last_block_is_computed_over_a_ladder_of_widths() -> None:
    def widths(blocks: PagedBlocks, page_size: int = 16) -> tuple[int, ...]:
        plan = make_plan(
            blocks,
            batch=1,
            max_pages=64,
            page_size=page_size,
            n_heads=12,
            n_kv_heads=12,
            head_dim=64,
            q_dtype=jnp.bfloat16,
            pool_dtype=jnp.bfloat16,
        )
        return plan.widths

    assert widths(PagedBlocks()) == (128, 256, 512)
    assert widths(PagedBlocks(block_tokens=128)) == (128,)
    assert widths(PagedBlocks(pages_per_block=64)) == (128, 256, 512, 1024)
    assert widths(PagedBlocks(pages_per_block=24)) == (384,)  # 192 is no multiple of 128
    assert widths(PagedBlocks(pages_per_block=1)) == (16,)  # narrower than a lane row: as is
    assert widths(PagedBlocks(pages_per_block=8, min_width=4), page_size=4) == (4, 8, 16, 32)


def test_mosaic_tiles_pages_of_whole_sublane_tiles_only() -> None:
    assert mosaic_problem(16, jnp.bfloat16) is None and mosaic_problem(8, jnp.float32) is None
    problem = mosaic_problem(8, jnp.bfloat16)
    assert problem is not None and "inference.page_size = 8" in problem and "16" in problem
    assert runs_pallas(1, 8, jnp.bfloat16, "cpu")  # interpret mode has no tiling rules
    assert not runs_pallas(1, 8, jnp.bfloat16, "tpu", tpu=True)
    assert runs_pallas(1, 16, jnp.bfloat16, "tpu", tpu=True)
    assert not runs_pallas(2, 16, jnp.bfloat16, "tpu", tpu=True)
    assert not runs_pallas(1, 16, "float32", "gpu", tpu=True)
    # Validated on a chip: the registered kernel decodes by Pallas there, unless the gate
    # is turned off, which sends a TPU decode back to paged_xla.
    assert CHIP_VALIDATED and runs_pallas(1, 16, jnp.bfloat16, "tpu")
    assert not runs_pallas(1, 16, jnp.bfloat16, "tpu", tpu=False)


@pytest.mark.parametrize("field", ["block_tokens", "pages_per_block", "rows_per_step", "min_width"])
def test_block_knobs_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"PagedBlocks.{field}"):
        PagedBlocks(**{field: 0})  # pyright: ignore[reportArgumentType]


def test_a_block_needs_two_slots_at_least() -> None:
    with pytest.raises(ValueError, match=r"PagedBlocks\.slots: must be at least 2"):
        PagedBlocks(slots=1)


def test_pallas_pairs_with_the_paged_pallas_kernel() -> None:
    assert PAGED_FOR["pallas"] == "paged_pallas"
    assert isinstance(PAGED_KERNELS["paged_pallas"], PagedPallas)


# ---------------------------------------------------------------- against the spec


@dataclass(frozen=True)
class Case:
    """One compiled shape: batch, page size, query and kv heads, the kernel's blocks,
    dtype."""

    batch: int
    page_size: int
    heads: tuple[int, int]
    blocks: PagedBlocks
    dtype: str = "float32"

    @property
    def n_kv(self) -> int:
        return self.heads[1]

    @property
    def max_pages(self) -> int:
        return pg.max_pages_for(MAX_LEN, self.page_size)

    @property
    def num_pages(self) -> int:
        return self.batch * self.max_pages + 3  # every row's pages and a few spare ones


CASES = {
    # Several blocks per row and several steps (rows padded from 3 to 4).
    "pages-of-4-G2-blocks-of-2-pages": Case(
        3, 4, (4, 2), PagedBlocks(pages_per_block=2, rows_per_step=2)
    ),
    # The default plan: one lane-dense block (3 pages -> 8) holds a whole row; MHA.
    "pages-of-16-G1-default": Case(3, 16, (2, 2), PagedBlocks()),
    # One page per block, MQA, every row in one step.
    "pages-of-8-G4-one-page-blocks": Case(3, 8, (4, 1), PagedBlocks(pages_per_block=1)),
    # Pages that fit no tile, blocks across a whole number of them.
    "pages-of-5-G2-blocks-of-3-pages": Case(
        3, 5, (4, 2), PagedBlocks(pages_per_block=3, rows_per_step=3)
    ),
    # Blocks of 32 tokens computed over the narrowest of 4, 8, 16 or 32 slots that holds a
    # row's last block: the width ladder, at test sizes.
    "pages-of-4-G1-width-ladder": Case(
        3, 4, (2, 2), PagedBlocks(pages_per_block=8, min_width=4, rows_per_step=3)
    ),
    # Three slots: two items' copies in flight, the cursor crossing rows and the step's end.
    "pages-of-4-G2-three-slots": Case(
        3, 4, (4, 2), PagedBlocks(pages_per_block=2, rows_per_step=3, slots=3)
    ),
    # bf16, one page per block.
    "bf16-pages-of-16-G2-one-page-blocks": Case(
        3, 16, (4, 2), PagedBlocks(pages_per_block=1), "bfloat16"
    ),
}
BATCHES = {
    "one-row": Case(1, 8, (4, 2), PagedBlocks(pages_per_block=2)),
    "five-rows-in-steps-of-2": Case(5, 8, (4, 2), PagedBlocks(pages_per_block=2, rows_per_step=2)),
    # Four slots, one page per block: up to six blocks a row, three items ahead.
    "five-rows-four-slots": Case(
        5, 8, (4, 2), PagedBlocks(pages_per_block=1, rows_per_step=2, slots=4)
    ),
}


def draw_table(rng: np.random.Generator, case: Case, lengths: list[int], layout: str) -> np.ndarray:
    """Each row's pages for its length plus a random reserve, drawn from a shuffled pool:
    one row after another (``"rows"``), page ``j`` of every row before page ``j + 1``
    (``"interleaved"``), or interleaved with one page inside the longest row's length
    missing (``"hole"``). ``NO_PAGE`` after each row's pages."""
    ps, n = case.page_size, case.max_pages
    held = [min(n, -(-max(x, 1) // ps) + int(rng.integers(0, 2))) for x in lengths]
    ids = list(rng.permutation(case.num_pages))
    table = np.full((case.batch, n), case.num_pages, np.int32)
    if layout == "rows":
        for b in range(case.batch):
            table[b, : held[b]] = [ids.pop() for _ in range(held[b])]
    else:
        for j in range(n):
            for b in range(case.batch):
                if j < held[b]:
                    table[b, j] = ids.pop()
    if layout == "hole":
        b = int(np.argmax(lengths))
        if held[b] > 1:
            table[b, int(rng.integers(0, held[b] - 1))] = case.num_pages
    return table


def draw_positions(rng: np.random.Generator, case: Case, kinds: list[str]) -> np.ndarray:
    """Each row's query position: ``"one"`` (length 1), ``"page"`` (a whole number of
    pages), ``"all"`` (the last position), ``"done"`` (NO_SLOT: a finished row) or
    ``"any"``."""
    ps, out = case.page_size, []
    for kind in kinds:
        if kind == "one":
            out.append(0)
        elif kind == "page":
            out.append(ps * int(rng.integers(1, MAX_LEN // ps + 1)) - 1)
        elif kind == "all":
            out.append(MAX_LEN - 1)
        elif kind == "done":
            out.append(NO_SLOT)
        else:
            out.append(int(rng.integers(0, MAX_LEN)))
    return np.asarray(out, np.int32)[:, None]


@functools.cache
def attend(name: str, blocks: PagedBlocks | None = None):
    """``name``'s attention over a kv-head-major layer; ``paged_pallas`` is handed the same
    pages in its own lane-dense layout."""
    kern = PAGED_KERNELS[name] if blocks is None else PagedPallas(blocks)
    dense = isinstance(kern, PagedPallas)

    def run(q, layer, positions):
        return kern.attend_cache(q, from_head_major(layer) if dense else layer, positions)

    return jax.jit(run)


@functools.cache
def f32_reference():
    """``paged_reference``'s math on f32 copies of the inputs (the bf16 yardstick)."""

    def run(q, layer, positions):
        up = pg.PagedLayer(layer.k.astype(jnp.float32), layer.v.astype(jnp.float32), layer.table)
        return REFERENCE.attend_cache(q.astype(jnp.float32), up, positions)

    return jax.jit(run)


def inputs(case: Case, seed: int, kinds: list[str], layout: str):
    rng = np.random.default_rng(seed)
    positions = draw_positions(rng, case, kinds)
    lengths = [min(int(p) + 1, MAX_LEN) for p in positions[:, 0]]
    table = draw_table(rng, case, lengths, layout)
    shape = (case.n_kv, case.num_pages, case.page_size, D)
    k, v = (jnp.asarray(rng.standard_normal(shape), case.dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((case.batch, 1, case.heads[0], D)), case.dtype)
    return q, pg.PagedLayer(k, v, jnp.asarray(table)), jnp.asarray(positions)


def sees_something(layer: pg.PagedLayer, positions: jax.Array) -> np.ndarray:
    """``bool[B]``: the row's query sees at least one position (the spec is defined there;
    a row that sees nothing is the next test's)."""
    visible = pg.visible_slots(positions, layer.table, layer.num_pages, layer.page_size)
    return np.asarray(jnp.any(visible, axis=(1, 2)))


def check(case: Case, seed: int, kinds: list[str], layout: str) -> None:
    q, layer, positions = inputs(case, seed, kinds, layout)
    got = np.asarray(attend("paged_pallas", case.blocks)(q, layer, positions)).astype(np.float32)
    rows = sees_something(layer, positions)
    if case.dtype == "float32":
        want = np.asarray(attend("paged_reference")(q, layer, positions))
        np.testing.assert_allclose(got[rows], want[rows], atol=2e-6, rtol=1e-5)
    else:
        want = np.asarray(f32_reference()(q, layer, positions))
        bound = 4 * BF16_U * float(np.max(np.abs(np.asarray(layer.v, np.float32))))
        np.testing.assert_allclose(got[rows], want[rows], atol=bound, rtol=0)
    np.testing.assert_array_equal(got[~rows], 0.0)


KIND = st.sampled_from(["one", "page", "all", "done", "any", "any"])
LAYOUT = st.sampled_from(["rows", "interleaved", "hole"])


@pytest.mark.parametrize("name", list(CASES))
@SETTINGS
@example(kinds=["one", "page", "all"], layout="rows", seed=0)
@example(kinds=["page", "done", "one"], layout="hole", seed=1)
@given(kinds=st.lists(KIND, min_size=3, max_size=3), layout=LAYOUT, seed=st.integers(0, 2**16))
def test_decode_equals_the_reference(name: str, kinds: list[str], layout: str, seed: int) -> None:
    check(CASES[name], seed, kinds, layout)


@pytest.mark.parametrize("name", list(BATCHES))
@settings(max_examples=3, deadline=None, derandomize=True)
@given(kind=KIND, layout=LAYOUT, seed=st.integers(0, 2**16))
def test_decode_equals_the_reference_at_other_batch_sizes(
    name: str, kind: str, layout: str, seed: int
) -> None:
    case = BATCHES[name]
    kinds = [kind, *(["any", "page", "one", "all"][: case.batch - 1])]
    check(case, seed, kinds, layout)


def test_pages_past_a_rows_length_never_reach_its_output() -> None:
    """Every pool slot but those of visible positions (spare pages, each row's reserve,
    the slots past its position in its last page, and so what an earlier row's copies
    leave in the buffers) holds NaN keys and huge values: the outputs are the reference's
    over the clean pool. (Values must be finite, as for the reference: a probability of
    exactly 0 times NaN is NaN.)"""
    case = CASES["pages-of-4-G2-blocks-of-2-pages"]
    q, layer, positions = inputs(case, 5, ["any", "one", "page"], "interleaved")
    table, ps = np.asarray(layer.table), case.page_size
    ends = np.asarray(positions)[:, 0]
    needed = {int(table[b, j]) for b, p in enumerate(ends) for j in range(p // ps + 1)}
    junk = np.ones(case.num_pages, bool)
    junk[sorted(needed)] = False
    k, v = (np.array(x) for x in (layer.k, layer.v))
    for x, value in ((k, np.nan), (v, 1e6)):
        x[:, junk] = value
        for b, p in enumerate(ends):
            x[:, table[b, p // ps], p % ps + 1 :] = value
    junk_layer = pg.PagedLayer(jnp.asarray(k), jnp.asarray(v), layer.table)
    got = attend("paged_pallas", case.blocks)(q, junk_layer, positions)
    want = attend("paged_reference")(q, layer, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_a_row_that_sees_nothing_is_zero_and_leaves_the_others_alone() -> None:
    """Row 0 sees every position; then, in the same grid step (whose buffers now hold row
    0's pages), row 1 at position -1 (an idle row) and row 2 whose only visible page is
    missing: both come out as zeros, row 0 as the reference."""
    case = CASES["pages-of-5-G2-blocks-of-3-pages"]
    q, layer, positions = inputs(case, 9, ["all", "one", "one"], "rows")
    table = np.asarray(layer.table).copy()
    table[2, 0] = case.num_pages
    positions = positions.at[1, 0].set(-1)
    layer = pg.PagedLayer(layer.k, layer.v, jnp.asarray(table))
    got = np.asarray(attend("paged_pallas", case.blocks)(q, layer, positions))
    np.testing.assert_array_equal(got[1:], 0.0)
    want = np.asarray(attend("paged_reference")(q, layer, positions))
    np.testing.assert_allclose(got[0], want[0], atol=2e-6, rtol=1e-5)


def test_several_tokens_per_row_are_paged_xlas() -> None:
    """``T > 1`` (extend) is not the decode kernel's: it must equal ``paged_xla`` exactly."""
    case = CASES["pages-of-16-G1-default"]
    q, layer, _ = inputs(case, 2, ["any"] * 3, "rows")
    q2 = jnp.concatenate([q, q * 0.5], axis=1)
    positions = jnp.asarray([[3, 4], [20, 21], [46, 47]], jnp.int32)
    got = attend("paged_pallas", case.blocks)(q2, layer, positions)
    want = attend("paged_xla")(q2, layer, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_pool_in_another_layout_is_paged_xlas() -> None:
    """A kv-head-major float pool (another kernel's) is read by ``paged_xla``, exactly."""
    case = CASES["pages-of-16-G1-default"]
    q, layer, positions = inputs(case, 3, ["any"] * 3, "rows")
    got = PagedPallas().attend_cache(q, layer, positions)
    want = attend("paged_xla")(q, layer, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
