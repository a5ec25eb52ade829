"""The XLA:CPU layouts' own invariants: the blocked cache covers its slots, and row buckets
compute the leading rows exactly (what they skip comes out as zeros)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.kernels import blocked
from jaxlab.kernels.blocked import MIN_BLOCKED_LEN, N_BLOCKS, block_starts, cache_blocks
from jaxlab.kernels.rows import Rows, row_buckets


@given(max_len=st.integers(2, 4096))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_cache_blocks_cover_the_cache(max_len: int) -> None:
    sizes = cache_blocks(max_len)
    assert sum(sizes) == max_len and all(n > 0 for n in sizes)
    if max_len < MIN_BLOCKED_LEN:
        assert sizes == (max_len,)
    else:
        assert len(sizes) <= N_BLOCKS
        assert all(n % 8 == 0 for n in sizes[:-1]) and sizes[-1] <= sizes[0]
    starts = block_starts(sizes)
    assert starts[0] == 0 and all(
        a + n == b for a, n, b in zip(starts, sizes, starts[1:], strict=False)
    )


def test_a_prefill_longer_than_the_cache_is_refused() -> None:
    a = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="shorter than the prefill"):
        blocked.fill(a, a, 4)


@pytest.mark.parametrize(
    ("slots", "buckets"),
    [(1, (1,)), (3, (1, 3)), (4, (1, 4)), (8, (1, 4, 8)), (16, (1, 4, 16)), (64, (1, 4, 16, 64))],
)
def test_row_buckets(slots: int, buckets: tuple[int, ...]) -> None:
    assert row_buckets(slots) == buckets


@jax.jit
def bucketed(x: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    rows = Rows.up_to_last(active, row_buckets(16))
    (y,) = rows.run(lambda r, x: (jnp.sin(x[:r]) * 2.0,), x)
    return y, rows.computed()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(active=st.sets(st.integers(0, 15), max_size=16))
def test_rows_compute_the_smallest_bucket_holding_the_last_active_row(active: set[int]) -> None:
    x = jnp.arange(16 * 3, dtype=jnp.float32).reshape(16, 3)
    mask = np.zeros(16, bool)
    mask[list(active)] = True
    y, computed = bucketed(x, jnp.asarray(mask))
    r = next(b for b in row_buckets(16) if b > max(active, default=-1))
    assert np.asarray(computed).tolist() == [i < r for i in range(16)]
    np.testing.assert_allclose(np.asarray(y)[:r], np.sin(np.asarray(x)[:r]) * 2.0, rtol=1e-6)
    assert not np.asarray(y)[r:].any()
    assert Rows.all(16).computed().all()
