"""``reduce_last`` in two stages (XLA:CPU's form) equals the one-pass reduction (the reference)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.kernels.reduce import ReduceOp, argmax_last, lanes_for, reduce_last, softmax_last
from jaxlab.runtime import tuning

#: Axis lengths with and without a chunk width: 8192 (the bench vocabulary, 256-wide
#: chunks), 256 and 96 (narrower chunks), 16 and 300 (no split: one plain reduce).
SIZES = [16, 96, 256, 300, 8192]


@functools.cache
def jitted(op: ReduceOp):
    """The two-stage form, whatever this platform's default."""
    return jax.jit(functools.partial(reduce_last, op=op, two_stage=True))


def test_the_cpu_takes_two_stages_and_accelerators_one():
    assert tuning.tuning_for("cpu").two_stage_reductions
    assert not tuning.tuning_for("tpu").two_stage_reductions
    assert not tuning.tuning_for("gpu").two_stage_reductions
    assert tuning.current() == tuning.tuning_for(jax.default_backend())


def test_lanes_for_picks_the_widest_chunk_that_splits_the_axis():
    assert lanes_for(8192) == 256
    assert lanes_for(512) == 256
    assert lanes_for(256) == 128
    assert lanes_for(96) == 32
    assert lanes_for(16) is None  # a single 16-wide chunk: nothing to split
    assert lanes_for(300) is None  # no width divides it


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from(SIZES),
    rows=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
)
def test_max_and_min_are_exact_and_sum_matches_to_rounding(n, rows, seed, ties):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, n)).astype(np.float32) * 4
    if ties:  # repeated extremes and -inf entries (masked logits)
        x = np.round(x)
        x[:, rng.integers(0, n, size=max(1, n // 8))] = -np.inf
        x[:, 0] = np.nanmax(np.where(np.isinf(x), np.nan, x), axis=-1)
    np.testing.assert_array_equal(np.asarray(jitted("max")(jnp.asarray(x))), x.max(axis=-1))
    np.testing.assert_array_equal(np.asarray(jitted("min")(jnp.asarray(x))), x.min(axis=-1))
    finite = np.where(np.isinf(x), 0.0, x)
    got = np.asarray(jitted("sum")(jnp.asarray(finite)))
    np.testing.assert_allclose(got, finite.sum(axis=-1, dtype=np.float64), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("n", SIZES)
def test_integer_min_is_exact(n: int):
    """argmax's first-index search is an int32 min over ``where(x == max, iota, n)``."""
    rng = np.random.default_rng(n)
    x = rng.integers(-50, 50, size=(4, n)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(jitted("min")(jnp.asarray(x))), x.min(axis=-1))


def test_leading_axes_are_kept():
    x = jnp.arange(2 * 3 * 512, dtype=jnp.float32).reshape(2, 3, 512)
    np.testing.assert_array_equal(np.asarray(jitted("max")(x)), np.asarray(x).max(axis=-1))
    assert jitted("sum")(x).shape == (2, 3)


@pytest.mark.parametrize("n", [16, 192, 8192])
def test_softmax_last_matches_jax_softmax_and_its_gradient(n: int):
    rng = np.random.default_rng(n)
    x = jnp.asarray(rng.normal(size=(3, n)).astype(np.float32) * 5)
    x = x.at[:, 1].set(-0.7 * float(jnp.finfo(jnp.float32).max))  # a masked logit
    g = jnp.asarray(rng.normal(size=(3, n)).astype(np.float32))
    two_stage = functools.partial(softmax_last, two_stage=True)
    ours, ref = jax.jit(two_stage)(x), jax.nn.softmax(x, axis=-1)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-7)
    assert float(ours[0, 1]) == 0.0

    def vjp(f):
        return jax.jit(jax.grad(lambda x: jnp.sum(f(x) * g)))(x)

    np.testing.assert_allclose(
        np.asarray(vjp(two_stage)),
        np.asarray(vjp(lambda x: jax.nn.softmax(x, axis=-1))),
        rtol=1e-4,
        atol=1e-6,
    )


@settings(max_examples=20, deadline=None, derandomize=True)
@given(n=st.sampled_from(SIZES), seed=st.integers(0, 2**31 - 1), two_stage=st.booleans())
def test_argmax_last_is_the_first_index_of_the_maximum(n, seed, two_stage):
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(3, n)) * 2).astype(np.float32)  # many ties
    got = jax.jit(functools.partial(argmax_last, two_stage=two_stage))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), x.argmax(axis=-1))
