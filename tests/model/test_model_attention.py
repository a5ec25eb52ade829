"""Masks and rotary positions: the pieces of attention that are the model's, not a kernel's.

(The attention math itself is tested kernel by kernel against the reference in
``tests/kernels``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlab.kernels.masks import cache_mask, causal_mask, padding_mask, segment_mask
from jaxlab.model import apply_rope, rope_tables


def test_mask_helpers() -> None:
    np.testing.assert_array_equal(causal_mask(3)[0, 0], np.tril(np.ones((3, 3), bool)))
    seg = jnp.array([[1, 1, 2]])
    np.testing.assert_array_equal(
        segment_mask(seg)[0, 0],
        np.array([[1, 1, 0], [1, 1, 0], [0, 0, 1]], bool),
    )
    np.testing.assert_array_equal(
        padding_mask(jnp.array([2, 0]), 3)[:, 0, 0],
        np.array([[1, 1, 0], [0, 0, 0]], bool),
    )
    # Cache mask: slot s visible iff s <= query position.
    np.testing.assert_array_equal(
        cache_mask(jnp.array([[1], [3]]), 4)[:, 0, 0],
        np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool),
    )
    both = causal_mask(3) & segment_mask(seg)
    assert both.shape == (1, 1, 3, 3)
    assert both.dtype == jnp.bool_


def test_rope_scores_depend_only_on_relative_position() -> None:
    d = 16
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, d)), jnp.float32)

    @jax.jit
    def score_at(m: jax.Array, n: jax.Array) -> jax.Array:
        sq, cq = rope_tables(m.reshape(1, 1), d, 10_000.0)
        sk, ck = rope_tables(n.reshape(1, 1), d, 10_000.0)
        return jnp.sum(apply_rope(q, sq, cq) * apply_rope(k, sk, ck))

    def score(m: int, n: int) -> float:
        return float(score_at(jnp.int32(m), jnp.int32(n)))

    base = score(7, 3)
    for shift in (1, 10, 50):
        assert score(7 + shift, 3 + shift) == pytest.approx(base, abs=1e-4)
    assert score(7, 7) == pytest.approx(float(jnp.sum(q * k)), abs=1e-4)  # zero offset
    # Rotation preserves the norm and the input dtype.
    s, c = rope_tables(jnp.array([[5]]), d, 10_000.0)
    assert float(jnp.linalg.norm(apply_rope(q, s, c))) == pytest.approx(
        float(jnp.linalg.norm(q)), rel=1e-5
    )
    assert apply_rope(q.astype(jnp.bfloat16), s, c).dtype == jnp.bfloat16
