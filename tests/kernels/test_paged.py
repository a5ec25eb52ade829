"""The paged kernels equal contiguous attention, whatever the page table looks like.

Each row's K/V is written into a pool through a random page table (hypothesis chooses the
page size, the rows' lengths, and the fragmentation: page ids shuffled across the pool,
rows' pages interleaved, spare pages, a ``NO_PAGE`` tail), then both paged kernels
attend from random positions; the result must equal the reference kernel over the same
K/V laid out contiguously. Writes through ``NO_PAGE`` or at ``NO_SLOT`` must change
nothing. Staging (XLA:CPU's decode calls) must hold exactly the pages, and read back
exactly the positions a call wrote. Shapes are fixed per page size, so each kernel compiles a few programs and
hypothesis varies the data.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxlab import kernels
from jaxlab.kernels import KERNELS, NO_SLOT, PAGED_FOR, PAGED_KERNELS, blocked
from jaxlab.kernels import paged as pg
from jaxlab.kernels.masks import cache_mask
from jaxlab.kernels.paged import page_buckets
from jaxlab.kernels.reference import attention
from jaxlab.kernels.staged import stage, stage_length, stage_lengths, written

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)
#: ``paged_pallas`` runs in Pallas interpret mode here, a compile of seconds per shape: its
#: own file (test_pallas_paged.py) holds it to ``paged_reference`` over shapes of its own.
PAGED = [name for name in PAGED_KERNELS if name != "paged_pallas"]
B, H, D = 3, 4, 8
MAX_LEN = 48
PAGE_SIZES = [1, 5, 16]  # 5: max_len is not a whole number of pages


def normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def pool_pages(page_size: int) -> int:
    """A fixed pool size per page size (a pool's shape is a compile): every row's pages
    and a few spare ones."""
    return B * pg.max_pages_for(MAX_LEN, page_size) + 3


def page_table(
    rng: np.random.Generator, lengths: list[int], page_size: int, interleave: bool
) -> tuple[np.ndarray, int]:
    """A table giving row ``b`` pages for ``lengths[b]`` tokens (plus a random reserve),
    drawn from a shuffled pool of ``pool_pages(page_size)`` pages (the ones nobody holds
    are spare); ``NO_PAGE`` after each row's pages."""
    max_pages = pg.max_pages_for(MAX_LEN, page_size)
    held = [min(max_pages, -(-n // page_size) + int(rng.integers(0, 2))) for n in lengths]
    num_pages = pool_pages(page_size)
    ids = list(rng.permutation(num_pages))
    table = np.full((len(lengths), max_pages), num_pages, np.int32)
    if interleave:  # page j of every row before page j + 1 of any
        for j in range(max_pages):
            for b in range(len(lengths)):
                if j < held[b]:
                    table[b, j] = ids.pop()
    else:
        for b in range(len(lengths)):
            table[b, : held[b]] = [ids.pop() for _ in range(held[b])]
    return table, num_pages


@functools.cache
def paged_ops(name: str, n_kv: int, t: int):
    """Write ``k, v [B, MAX_LEN, K, D]`` from position 0 through ``table`` into a pool of
    ``num_pages`` pages, then attend ``q [B, t, H, D]`` at ``positions`` (one program)."""
    kern = PAGED_KERNELS[name]

    def run(pool: pg.PagedCache, table, k, v, q, positions):
        layer = pg.PagedLayer(pool.k, pool.v, table)
        layer = kern.write(layer, k, v, jnp.zeros((k.shape[0],), jnp.int32))
        return kern.attend_cache(q, layer, positions), kern.to_bskd(layer)

    return jax.jit(run)


@functools.cache
def contiguous(n_kv: int, t: int):
    def run(k, v, q, positions):
        return attention(q, k, v, cache_mask(positions, k.shape[1]))

    return jax.jit(run)


def pool_of(num_pages: int, page_size: int, n_kv: int, seed: int) -> pg.PagedCache:
    """A pool full of noise: a kernel that read a page it should not would show it."""
    rng = np.random.default_rng(seed)
    shape = (n_kv, num_pages, page_size, D)
    return pg.PagedCache(jnp.asarray(normal(rng, *shape)), jnp.asarray(normal(rng, *shape)))


@pytest.mark.parametrize("name", PAGED)
@pytest.mark.parametrize("n_kv", [1, 2])
@pytest.mark.parametrize("t", [1, 3])
@SETTINGS
@example(page_size=16, lengths=[48, 3, 17], interleave=False, seed=0)
@example(page_size=1, lengths=[3, 48, 9], interleave=True, seed=1)
@given(
    page_size=st.sampled_from(PAGE_SIZES),
    lengths=st.lists(st.integers(3, MAX_LEN), min_size=B, max_size=B),
    interleave=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_equals_contiguous_attention(
    name, n_kv, t, page_size, lengths, interleave, seed
):
    rng = np.random.default_rng(seed)
    table, num_pages = page_table(rng, lengths, page_size, interleave)
    k, v = normal(rng, B, MAX_LEN, n_kv, D), normal(rng, B, MAX_LEN, n_kv, D)
    q = normal(rng, B, t, H, D)
    ends = np.array([rng.integers(t - 1, n) for n in lengths])  # each row's last query
    positions = (ends[:, None] - np.arange(t)[::-1][None, :]).astype(np.int32)
    pool = pool_of(num_pages, page_size, n_kv, seed + 1)
    out, (gk, _) = paged_ops(name, n_kv, t)(pool, jnp.asarray(table), k, v, q, positions)
    want = contiguous(n_kv, t)(k, v, q, positions)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=1e-5)
    # Every position a row holds a page for reads back what was written there.
    gk = np.asarray(gk)
    for b in range(B):
        held = int(np.sum(table[b] < num_pages)) * page_size
        np.testing.assert_array_equal(gk[b, : min(held, MAX_LEN)], k[b, : min(held, MAX_LEN)])


@functools.cache
def write_fn():
    return jax.jit(pg.write)


@SETTINGS
@given(
    page_size=st.sampled_from(PAGE_SIZES),
    starts=st.lists(st.sampled_from([0, 1, 7, 30, 46, NO_SLOT]), min_size=B, max_size=B),
    seed=st.integers(0, 2**16),
)
def test_writes_without_a_page_or_at_no_slot_are_dropped(page_size, starts, seed):
    """Row 1 holds no page at all, the others a few; every token whose page is NO_PAGE,
    past the table, or at NO_SLOT changes nothing. The rest land exactly where the table
    says, checked slot by slot in numpy."""
    rng = np.random.default_rng(seed)
    t, n_kv = 4, 2
    table, num_pages = page_table(rng, [20, 1, 40], page_size, interleave=True)
    table[1] = num_pages  # a row without pages
    pool = pool_of(num_pages, page_size, n_kv, seed)
    k, v = normal(rng, B, t, n_kv, D), normal(rng, B, t, n_kv, D)
    layer = pg.PagedLayer(pool.k, pool.v, jnp.asarray(table))
    got = write_fn()(layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(starts, jnp.int32))
    want_k = np.asarray(pool.k).copy()
    for b in range(B):
        for j in range(t):
            p = starts[b] + j
            if p >= NO_SLOT or p // page_size >= table.shape[1]:
                continue
            page = table[b, p // page_size]
            if page < num_pages:
                want_k[:, page, p % page_size] = k[b, j]
    np.testing.assert_array_equal(np.asarray(got.k), want_k)
    assert np.array_equal(np.asarray(got.table), table)


@SETTINGS
@given(
    page_size=st.sampled_from(PAGE_SIZES),
    starts=st.lists(st.sampled_from([0, 1, 7, 30, 44]), min_size=B, max_size=B),
    seed=st.integers(0, 2**16),
)
def test_read_at_gives_back_what_write_at_put_there(page_size, starts, seed):
    """``read_at`` is ``write_at``'s inverse where a row has pages: the K/V written at those
    positions come back, and writing what was read puts the pool back as it was (how a
    speculative verify rolls back the positions it rejected)."""
    rng = np.random.default_rng(seed)
    t, n_kv = 4, 2
    table, num_pages = page_table(rng, [48, 20, 48], page_size, interleave=False)
    pool = pool_of(num_pages, page_size, n_kv, seed)
    layer = pg.PagedLayer(pool.k, pool.v, jnp.asarray(table))
    positions = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)
    held = np.asarray(positions) // page_size < (table < num_pages).sum(axis=1)[:, None]
    before_k, before_v = jax.jit(pg.read_at)(layer, positions)
    k, v = normal(rng, B, t, n_kv, D), normal(rng, B, t, n_kv, D)
    written_layer = jax.jit(pg.write_at)(layer, jnp.asarray(k), jnp.asarray(v), positions)
    got_k, got_v = jax.jit(pg.read_at)(written_layer, positions)
    np.testing.assert_array_equal(np.asarray(got_k)[held], k[held])
    np.testing.assert_array_equal(np.asarray(got_v)[held], v[held])
    restored = jax.jit(pg.write_at)(written_layer, before_k, before_v, positions)
    np.testing.assert_array_equal(np.asarray(restored.k), np.asarray(pool.k))
    np.testing.assert_array_equal(np.asarray(restored.v), np.asarray(pool.v))


@functools.cache
def long_ops(name: str):
    kern = PAGED_KERNELS[name]

    def run(layer, q, positions):
        return kern.attend_cache(q, layer, positions)

    return jax.jit(run)


LONG_PAGES, LONG_PS = 16, 16  # page counts 4, 8, 12, 16: the switch over visible pages


@SETTINGS
@example(ends=[0, 63, 5], seed=0)  # the fewest pages
@example(ends=[64, 3, 3], seed=1)  # one position past them
@example(ends=[191, 192, 0], seed=2)  # twelve pages, then all
@example(ends=[255, 0, 0], seed=3)  # every page
@given(
    ends=st.lists(
        st.sampled_from([0, 1, 62, 63, 64, 65, 127, 128, 129, 191, 192, 255]),
        min_size=B,
        max_size=B,
    ),
    seed=st.integers(0, 2**16),
)
def test_reading_only_the_visible_pages_equals_the_reference(ends, seed):
    """Queries around each page-count bucket (positions 63/64, 127/128, 191/192): the
    kernel that reads only the leading pages some query can see equals the one that reads
    them all."""
    assert page_buckets(LONG_PAGES, LONG_PS) == (4, 8, 12, 16)
    rng = np.random.default_rng(seed)
    num_pages = B * LONG_PAGES
    table = rng.permutation(num_pages).reshape(B, LONG_PAGES).astype(np.int32)
    pool = pool_of(num_pages, LONG_PS, 2, seed)
    layer = pg.PagedLayer(pool.k, pool.v, jnp.asarray(table))
    q = jnp.asarray(normal(rng, B, 1, H, D))
    positions = jnp.asarray(ends, jnp.int32)[:, None]
    got = long_ops("paged_xla")(layer, q, positions)
    want = long_ops("paged_reference")(layer, q, positions)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def test_page_buckets_and_table_width():
    assert page_buckets(16, 16) == (4, 8, 12, 16)
    assert page_buckets(64, 16) == (4, 8, 16, 32, 48, 64)
    assert page_buckets(8, 16) == (4, 6, 8)
    assert page_buckets(3, 16) == (3,)
    assert page_buckets(100, 1) == (64, 89, 100)
    assert pg.max_pages_for(48, 5) == 10 and pg.max_pages_for(48, 16) == 3


def test_leading_rows_slice_the_table_only():
    pool = pool_of(6, 4, 1, 0)
    table = jnp.asarray([[0, 1], [2, 3], [4, 6]], jnp.int32)
    layer = pg.PagedLayer(pool.k, pool.v, table)
    for name in PAGED:
        lead = PAGED_KERNELS[name].take_rows(layer, 2)
        assert lead.k is pool.k and lead.table.shape == (2, 2)
        assert PAGED_KERNELS[name].take_rows(layer, 3) is layer


def test_every_kernel_has_a_paged_counterpart():
    assert set(PAGED_FOR) == set(kernels.KERNELS)
    assert PAGED_FOR["reference"] == "paged_reference"
    assert PAGED_FOR["pallas"] == "paged_pallas"
    others = {PAGED_FOR[n] for n in kernels.KERNELS if n not in ("reference", "pallas")}
    assert others == {"paged_xla"}
    assert kernels.get_paged("auto").name == "paged_xla"
    assert set(PAGED_FOR.values()) == set(PAGED_KERNELS)
    pool = PAGED_KERNELS["paged_xla"].init_pool(5, 4, 2, D, jnp.bfloat16)
    assert pool.k.shape == (2, 5, 4, D) and pool.k.dtype == jnp.bfloat16
    assert pool.num_pages == 5 and pool.page_size == 4


# ------------------------------------------------------------------------------ staging


@functools.cache
def stage_fn(name: str, max_len: int):
    return jax.jit(lambda layer: KERNELS[name].to_bskd(stage(KERNELS[name], layer, max_len)))


@pytest.mark.parametrize("name", ["xla_cpu", "reference"])
@pytest.mark.parametrize("max_len", [48, 40])  # 40: blocks of 16, 16, 8 cross pages of 16
def test_staging_holds_every_rows_pages_in_the_contiguous_layout(name, max_len):
    """A staged contiguous cache equals the pages gathered position by position, for the
    blocked layout read straight from the pool (blocks on page boundaries) and through
    gather-then-fill (blocks across them, and the reference's layout)."""
    rng = np.random.default_rng(3)
    table, num_pages = page_table(rng, [40, 17, 33], 16, interleave=True)
    pool = pool_of(num_pages, 16, 2, seed=4)
    layer = pg.PagedLayer(pool.k, pool.v, jnp.asarray(table))
    k, v = stage_fn(name, max_len)(layer)
    want_k, want_v = pg.gather(layer)
    assert k.shape == (B, max_len, 2, D)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(want_k)[:, :max_len])
    np.testing.assert_array_equal(np.asarray(v), np.asarray(want_v)[:, :max_len])
    if name == "xla_cpu":
        assert (blocked.from_pages(pool.k, pool.v, layer.table, max_len) is None) == (max_len == 40)


def test_a_staged_length_holds_the_last_page_any_row_names():
    """The staged lengths are the page buckets in tokens, capped at ``max_len``; a table
    stages the shortest that reaches past its last named page, whichever row names it,
    and an empty table the shortest of all."""
    assert stage_lengths(256, 16, 16) == (64, 128, 192, 256)
    assert stage_lengths(250, 16, 16) == (64, 128, 192, 250)
    assert stage_lengths(64, 16, 4) == (64,)
    lengths, no_page = stage_lengths(256, 16, 16), 40
    table = np.full((3, 16), no_page, np.int32)
    assert stage_length(table, no_page, 16, lengths) == 64
    for column, want in [(0, 64), (3, 64), (4, 128), (7, 128), (8, 192), (12, 256), (15, 256)]:
        t = table.copy()
        t[0, :2] = [5, 6]
        t[2, column] = 7  # a later row, and a column past its earlier ones: still counted
        assert stage_length(t, no_page, 16, lengths) == want, column


@pytest.mark.parametrize("name", ["xla_cpu", "reference"])
def test_what_a_staged_call_wrote_is_read_back_for_the_pages(name):
    """Positions ``start .. end - 1`` of each row come back out of the contiguous cache
    (across the blocked layout's block edges at 24, 48, 72); a row that starts at NO_SLOT,
    and positions from ``end`` on, come back as NO_SLOT."""
    kern, rng, s = KERNELS[name], np.random.default_rng(11), 96
    k_all, v_all = normal(rng, B, s, 2, D), normal(rng, B, s, 2, D)
    cache = kern.fill(jnp.asarray(k_all), jnp.asarray(v_all), s)
    start = jnp.asarray([22, 70, NO_SLOT], jnp.int32)
    end = jnp.asarray([27, 72, 5], jnp.int32)
    k, v, positions = jax.jit(written, static_argnums=(0, 4))(kern, cache, start, end, 6)
    want = np.asarray([[22, 23, 24, 25, 26, NO_SLOT], [70, 71] + [NO_SLOT] * 4, [NO_SLOT] * 6])
    np.testing.assert_array_equal(np.asarray(positions), want)
    for b in range(2):
        for i, p in enumerate(want[b]):
            if p < NO_SLOT:
                np.testing.assert_array_equal(np.asarray(k)[b, i], k_all[b, p])
                np.testing.assert_array_equal(np.asarray(v)[b, i], v_all[b, p])
