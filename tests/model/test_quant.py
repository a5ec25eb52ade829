"""int8 weights (``jaxlab.model.quant``): the quantizer's error bound, the int8 matmul against
the float one within a bound computed from the scales, and which parameters count as dense.

The bounds are derived, not tuned: a symmetric round-to-nearest quantizer with scale ``s``
is off by at most ``s / 2`` per element (plus float32 rounding of the division, ``s * 2^-17``
at most for values up to 127), so a dot over ``k`` inputs is off by at most
``s_j / 2 * sum_k |x_k|`` in output channel ``j``, plus the float32 accumulation error of
both dots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxlab.config import JaxlabConfig, ModelConfig, TokenizerConfig
from jaxlab.kernels import int8
from jaxlab.model import dense, make_model, split_model
from jaxlab.model.quant import (
    Activations,
    QuantizedKernel,
    is_dense_path,
    quantize_dense,
    quantize_kernel,
)

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
#: float32 rounding of ``x / s`` and of ``q * s`` relative to a quantum, for |q| <= 127.
ROUNDING = 256 * 2.0**-24


def finite(shape: tuple[int, ...]):
    """Zeros and magnitudes from 2^-20 to 2^10 (no subnormals: XLA:CPU flushes them)."""
    magnitudes = st.floats(2.0**-20, 1024.0, width=32)
    floats = st.one_of(st.just(0.0), magnitudes, magnitudes.map(lambda f: -f))
    return hnp.arrays(np.float32, shape, elements=floats)


#: A few shapes (each is a compile); hypothesis varies the values.
shapes = st.sampled_from([(1, 1, 1), (1, 37, 5), (3, 16, 24)])
_quantize = jax.jit(quantize_kernel)


@SETTINGS
@given(data=st.data(), shape=shapes, zero_column=st.booleans())
def test_round_trip_is_within_half_a_quantum_per_output_channel(data, shape, zero_column):
    lead, k, n = shape
    w = data.draw(finite((lead, k, n)))
    if zero_column:  # an all-zero channel: scale 0, read back as zeros
        w[..., 0] = 0.0
    qk = _quantize(jnp.asarray(w))
    q, scale = np.asarray(qk.values), np.asarray(qk.scale)
    assert q.dtype == np.int8 and scale.shape == (lead, n) and scale.dtype == np.float32
    assert np.abs(q.astype(np.int32)).max() <= int8.INT8_MAX
    np.testing.assert_allclose(scale, np.abs(w).max(axis=-2) / 127, rtol=1e-6)
    err = np.abs(np.asarray(qk.dequantize()) - w)
    bound = scale[:, None, :] * (0.5 + ROUNDING)
    assert np.all(err <= bound), float((err - bound).max())
    if zero_column:
        assert np.all(scale[:, 0] == 0) and np.all(np.asarray(qk.dequantize())[..., 0] == 0)
    # Each channel's largest weight maps to +-127: the whole int8 range is used.
    used = np.abs(q.astype(np.int32)).max(axis=-2)
    assert np.all((used == 127) | (scale == 0))


@functools.cache
def matmuls(activations: Activations):
    def run(x, w):
        return dense(x, w, jnp.float32), dense(x, quantize_kernel(w, activations), jnp.float32)

    return jax.jit(run)


@pytest.mark.parametrize("activations", ["float", "int8"])
@SETTINGS
@given(data=st.data(), shape=st.sampled_from([(1, 1, 1), (1, 64, 32), (5, 24, 9)]))
def test_int8_dense_equals_float_dense_within_the_scales_bound(data, activations, shape):
    rows, k, n = shape
    x = data.draw(finite((rows, k)))
    w = data.draw(finite((k, n)))
    want, got = (np.asarray(a, np.float64) for a in matmuls(activations)(x, w))
    qk = _quantize(jnp.asarray(w))
    s = np.asarray(qk.scale, np.float64)  # [n]
    q = np.asarray(qk.values, np.float64)
    ax = np.abs(x.astype(np.float64))
    # Weight rounding: s_j / 2 per weight.
    bound = ax.sum(1, keepdims=True) * s[None, :] * (0.5 + ROUNDING)
    if activations == "int8":
        # Activation rounding too: x_scale / 2 per input, times |q s| of the weight it meets.
        x_scale = ax.max(1, keepdims=True) / 127
        bound += x_scale * (0.5 + ROUNDING) * (np.abs(q) @ np.diag(s)).sum(0, keepdims=True)
    # float32 accumulation of both dots (k terms each), and of the final scaling.
    accum = 2 * (k + 2) * 2.0**-24 * (ax @ np.abs(w.astype(np.float64)) + np.abs(want))
    assert np.all(np.abs(got - want) <= bound + accum + 1e-30)


def test_the_int8_matmul_is_not_the_float_matmul():
    """A weight between two quanta must move: the comparison above is not vacuous."""
    w = jnp.asarray([[1.0, 0.5], [0.004, -0.25]], jnp.float32)  # 0.004 rounds to 0 * s
    x = jnp.asarray([[0.0, 1000.0]], jnp.float32)
    want, got = matmuls("float")(x, w)
    assert abs(float(got[0, 0]) - float(want[0, 0])) > 1.0  # 4.0 -> 0.0


def test_a_quantized_kernel_is_read_whole():
    qk = quantize_kernel(jnp.ones((4, 3)))
    assert qk[...] is qk and qk.shape == (4, 3)
    with pytest.raises(TypeError, match="read whole"):
        qk[0]


def tiny(**model: Any) -> JaxlabConfig:
    return JaxlabConfig(
        model=ModelConfig(
            vocab_size=258, n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_mlp=32, **model
        ),
        tokenizer=TokenizerConfig(kind="byte"),
    )


@pytest.mark.parametrize("tied", [False, True])
def test_every_dense_kernel_and_an_untied_head_are_quantized_nothing_else(tied):
    cfg = tiny(tie_embeddings=tied, positions="learned")
    _, params = split_model(make_model(cfg.model, cfg.train.precision, 0))

    def flat(state) -> dict:
        return {path: var.get_value() for path, var in nnx.to_flat_state(state)}

    before, q = flat(params), flat(quantize_dense(params))
    quantized = {path for path, value in q.items() if isinstance(value, QuantizedKernel)}
    per_block = {("attn", "w_qkv"), ("attn", "w_out"), ("mlp", "w_in"), ("mlp", "w_down")}
    want: set[tuple[Any, ...]] = {("blocks", i, *p) for i in range(2) for p in per_block}
    if not tied:
        want.add(("lm_head",))
    assert quantized == want
    for path, value in q.items():  # norms and embedding tables: unchanged
        if path not in want:
            np.testing.assert_array_equal(np.asarray(value), np.asarray(before[path]))
        else:
            assert value.shape == before[path].shape and value.values.dtype == jnp.int8
    again = flat(quantize_dense(quantize_dense(params)))  # idempotent: never quantized twice
    for path in want:
        np.testing.assert_array_equal(np.asarray(again[path].values), np.asarray(q[path].values))
    assert not is_dense_path(("embed", "table"), np.zeros((3, 3)))


def test_a_scanned_model_runs_its_stacked_int8_kernels_as_the_unrolled_one():
    """``scan_layers`` stacks each kernel along a layer axis; quantizing per output channel
    per layer and scanning gives the unrolled int8 model's logits."""
    flat_cfg, scan_cfg = tiny(), tiny(scan_layers=True)
    graphdef_s, stacked = split_model(make_model(scan_cfg.model, scan_cfg.train.precision, 0))
    graphdef_u, unrolled = split_model(make_model(flat_cfg.model, flat_cfg.train.precision, 0))
    tokens = jnp.asarray([[1, 5, 9, 2, 7]], jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)[None]

    def logits(graphdef, params):
        return nnx.merge(graphdef, quantize_dense(params))(tokens, positions)

    np.testing.assert_allclose(
        np.asarray(logits(graphdef_s, stacked)),
        np.asarray(logits(graphdef_u, unrolled)),
        atol=1e-5,
        rtol=1e-5,
    )
