"""The Pallas decode write equals ``write_at``'s scatter, bit for bit (CPU, Pallas
interpret mode).

The kernel writes the lane-dense pool (:mod:`jaxlab.kernels.paged_dense`); each case
draws a kv-head-major pool, writes it by ``paged.write``'s scatter, and compares that with
the kernel's write into the same pages converted, converted back.

Hypothesis chooses each row's position (a page's first or last slot, anywhere, a done
row's ``NO_SLOT``, past the table) and the table (shuffled pages, a ``NO_PAGE`` entry
where a row writes), over float32 and bfloat16 pools and rows per grid step that do and
do not divide the batch. Both sides only move values, so they must agree exactly, and
every page no row writes must be untouched.
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
from jaxlab.kernels.paged_dense import from_head_major, to_head_major
from jaxlab.kernels.paged_pallas import PagedPallas
from jaxlab.kernels.pallas_paged_write import write_token

K, PAGE, D, MAX_PAGES = 3, 4, 8, 4


@functools.cache
def pallas_write(rows: int):
    """The kernel on a kv-head-major layer's pages, lane-dense; new pools kv-head major."""

    def run(layer: pg.PagedLayer, k: jax.Array, v: jax.Array, positions: jax.Array):
        dense = from_head_major(layer)
        b = k.shape[0]
        k_pool, v_pool = write_token(
            dense.k, dense.v, dense.table, k.reshape(b, -1), v.reshape(b, -1), positions, rows=rows
        )
        back = to_head_major(pg.PagedLayer(k_pool, v_pool, layer.table, dense_heads=K))
        return back.k, back.v

    return jax.jit(run)


def draw(rng: np.random.Generator, batch: int, kinds: list[str], dtype: str):
    num_pages = batch * MAX_PAGES + 2
    table = rng.permutation(num_pages)[: batch * MAX_PAGES].reshape(batch, MAX_PAGES)
    positions = []
    for b, kind in enumerate(kinds):
        if kind == "first":
            positions.append(PAGE * int(rng.integers(0, MAX_PAGES)))
        elif kind == "last":
            positions.append(PAGE * int(rng.integers(1, MAX_PAGES + 1)) - 1)
        elif kind == "done":
            positions.append(NO_SLOT)
        elif kind == "past":
            positions.append(PAGE * MAX_PAGES + int(rng.integers(0, 3)))
        elif kind == "no-page":
            p = int(rng.integers(0, PAGE * MAX_PAGES))
            table[b, p // PAGE] = num_pages
            positions.append(p)
        else:
            positions.append(int(rng.integers(0, PAGE * MAX_PAGES)))
    pool = (K, num_pages, PAGE, D)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((batch, K, D)), dtype) for _ in range(2))
    layer = pg.PagedLayer(k_pool, v_pool, jnp.asarray(table, jnp.int32))
    return layer, k, v, jnp.asarray(positions, jnp.int32)


KIND = st.sampled_from(["first", "last", "any", "any", "done", "past", "no-page"])


@pytest.mark.parametrize(
    ("batch", "rows", "dtype"),
    [(5, 2, "float32"), (3, 32, "float32"), (4, 4, "bfloat16")],
    ids=["5-rows-in-steps-of-2", "3-rows-one-step", "bf16"],
)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_the_pallas_write_equals_the_scatter(
    batch: int, rows: int, dtype: str, data: st.DataObject, seed: int
) -> None:
    kinds = data.draw(st.lists(KIND, min_size=batch, max_size=batch))
    layer, k, v, positions = draw(np.random.default_rng(seed), batch, kinds, dtype)
    got_k, got_v = pallas_write(rows)(layer, k, v, positions)
    want = pg.write(layer, k[:, None], v[:, None], positions)
    np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want.k, np.float32))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want.v, np.float32))


def test_rows_that_write_nothing_leave_the_pool_alone() -> None:
    layer, k, v, positions = draw(
        np.random.default_rng(3), 4, ["done", "past", "no-page", "done"], "float32"
    )
    got_k, got_v = pallas_write(2)(layer, k, v, positions)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(layer.k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(layer.v))


def test_the_kernel_writes_one_token_by_pallas_and_the_rest_by_scatter(monkeypatch) -> None:
    """``PagedPallas.write``: one token into its lane-dense pool is the Pallas write;
    several tokens, an int8 pool, or a pool in another layout, the scatter."""
    import jaxlab.kernels.pallas_paged_write as module

    calls: list[int] = []
    real = module.write_token

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "write_token", counted)
    kern = PAGED_KERNELS["paged_pallas"]
    assert isinstance(kern, PagedPallas)
    layer, k, v, start = draw(np.random.default_rng(4), 2, ["any", "first"], "float32")
    dense = from_head_major(layer)
    one = kern.write(dense, k[:, None], v[:, None], start)
    assert calls == [1]
    want = pg.write(layer, k[:, None], v[:, None], start)
    np.testing.assert_array_equal(np.asarray(to_head_major(one).k), np.asarray(want.k))
    two = jnp.concatenate([k[:, None], k[:, None]], axis=1)
    both = kern.write(dense, two, two, jnp.zeros_like(start))
    want = pg.write(layer, two, two, jnp.zeros_like(start))
    np.testing.assert_array_equal(np.asarray(to_head_major(both).v), np.asarray(want.v))
    kern.write(layer, k[:, None], v[:, None], start)  # kv-head major: the scatter
    pool8 = pg.init_pool(layer.num_pages, PAGE, K, D, jnp.int8)
    int8_layer = pg.PagedLayer(pool8.k, pool8.v, layer.table, pool8.k_scale, pool8.v_scale)
    kern.write(int8_layer, k[:, None], v[:, None], start)
    assert calls == [1]
