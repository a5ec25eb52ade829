"""The lane-dense pool's operations equal their kv-head-major twins (``paged_dense`` against
``paged``).

Hypothesis chooses the page size, the rows' lengths, the fragmentation of the table
(``test_paged.py``'s drawing) and the positions written and read (including a done row's
``NO_SLOT`` and positions past the table). Each operation on the lane-dense pool, viewed
kv-head major by ``to_head_major``, must equal the same operation on the kv-head-major
pool exactly: the write (one token and several per row), ``read_at``, the contiguous
gather, and ``paged_xla``'s attention over either layout (how ``paged_pallas`` runs
prefill chunks). The layouts convert both ways without loss, and ``paged_pallas`` makes
its float pools lane-dense and its int8 pools kv-head major.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.kernels import NO_SLOT, PAGED_KERNELS
from jaxlab.kernels import paged as pg
from jaxlab.kernels import paged_dense as pd
from tests.kernels.test_paged import MAX_LEN, page_table, pool_of

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True)
B, H, K, D = 3, 4, 2, 8
XLA = PAGED_KERNELS["paged_xla"]


def draw(seed: int, page_size: int, lengths: list[int], interleave: bool) -> pg.PagedLayer:
    rng = np.random.default_rng(seed)
    table, num_pages = page_table(rng, lengths, page_size, interleave)
    pool = pool_of(num_pages, page_size, K, seed + 1)
    return pg.PagedLayer(pool.k, pool.v, jnp.asarray(table))


def positions_for(rng: np.random.Generator, t: int) -> np.ndarray:
    """``[B, t]`` consecutive positions per row, from anywhere in (or past) the table; one
    row may be done (``NO_SLOT``)."""
    starts = rng.integers(0, MAX_LEN + 4, B)
    out = starts[:, None] + np.arange(t)[None, :]
    if rng.integers(0, 2):
        out[int(rng.integers(0, B))] = NO_SLOT
    return out.astype(np.int32)


@functools.cache
def ops(t: int):
    def run(layer: pg.PagedLayer, k, v, positions, q):
        dense = pd.from_head_major(layer)
        mine = pd.write_at(dense, k, v, positions)
        theirs = pg.write_at(layer, k, v, positions)
        reads = (pd.read_at(mine, positions), pg.read_at(theirs, positions))
        gathers = (pd.gather(mine), pg.gather(theirs))
        # Attention at each row's last written position (clipped into the table).
        at = jnp.clip(positions, 0, MAX_LEN - 1)
        attends = (XLA.attend_cache(q, mine, at), XLA.attend_cache(q, theirs, at))
        return pd.to_head_major(mine), theirs, reads, gathers, attends

    return jax.jit(run)


PAGE_SIZE = st.sampled_from([1, 5, 16])
LENGTHS = st.lists(st.integers(1, MAX_LEN), min_size=B, max_size=B)


@pytest.mark.parametrize("t", [1, 3])
@SETTINGS
@given(page_size=PAGE_SIZE, lengths=LENGTHS, interleave=st.booleans(), seed=st.integers(0, 2**16))
def test_every_operation_equals_its_kv_head_major_twin(
    t: int, page_size: int, lengths: list[int], interleave: bool, seed: int
) -> None:
    layer = draw(seed, page_size, lengths, interleave)
    rng = np.random.default_rng(seed + 2)
    positions = jnp.asarray(positions_for(rng, t))
    k, v = (jnp.asarray(rng.standard_normal((B, t, K, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, t, H, D)), jnp.float32)
    mine, theirs, reads, gathers, attends = ops(t)(layer, k, v, positions, q)
    for a, b in (
        (mine.k, theirs.k),
        (mine.v, theirs.v),
        *zip(*reads, strict=True),
        *zip(*gathers, strict=True),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(attends[0]), np.asarray(attends[1]))


def test_the_layouts_convert_both_ways_without_loss() -> None:
    layer = draw(0, 5, [7, 48, 20], True)
    dense = pd.from_head_major(layer)
    assert dense.dense_heads == K and dense.k.shape == (layer.num_pages, 5, K * D)
    assert (dense.num_pages, dense.page_size) == (layer.num_pages, layer.page_size)
    # Token p of page n is [K * D] lanes, kv head j at lanes j * D .. (j + 1) * D.
    np.testing.assert_array_equal(
        np.asarray(dense.k[3, 2, D : 2 * D]), np.asarray(layer.k[1, 3, 2])
    )
    back = pd.to_head_major(dense)
    assert back.dense_heads is None
    np.testing.assert_array_equal(np.asarray(back.k), np.asarray(layer.k))
    np.testing.assert_array_equal(np.asarray(back.v), np.asarray(layer.v))


def test_paged_pallas_makes_float_pools_lane_dense_and_int8_pools_kv_head_major() -> None:
    kern = PAGED_KERNELS["paged_pallas"]
    pool = kern.init_pool(6, 4, K, D, jnp.bfloat16)
    assert pool.dense_heads == K and pool.k.shape == (6, 4, K * D) and pool.k.dtype == jnp.bfloat16
    assert (pool.num_pages, pool.page_size) == (6, 4)
    int8 = kern.init_pool(6, 4, K, D, jnp.int8)
    assert int8.dense_heads is None and int8.k.shape == (K, 6, 4, D) and int8.k_scale is not None
    with pytest.raises(ValueError, match="int8"):
        pd.init_pool(6, 4, K, D, jnp.int8)
    # A model's pages: the layer view keeps the layout.
    pages = pg.Pages((pool,), pg.no_pages(2, 3, 6))
    assert pages.layer(0).dense_heads == K and pages.num_pages == 6
