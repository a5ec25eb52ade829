"""AOT timing: trace, lower, compile, first call and steady state timed apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlab.bench.compile import mlp_flops, time_aot, time_new_shape


def test_time_aot_times_every_stage_and_the_ratio():
    f = jax.jit(lambda x: jnp.tanh(x) @ x)  # a jitted function works as well as a plain one
    t = time_aot(f, (jnp.ones((16, 16)),), repeats=2, steady_warmup=1, steady_repeats=3)
    for name, s in t.phases().items():
        assert s.ok and len(s.times_s) == 2 and all(x > 0 for x in s.times_s), name
    assert t.steady.ok and len(t.steady.times_s) == 3
    assert t.first_over_steady is not None and t.first_over_steady > 0
    assert t.cost_analysis_flops is None or t.cost_analysis_flops > 0


def test_time_aot_failure_lands_on_every_stage():
    t = time_aot(lambda x: x.reshape(3), (jnp.ones((4,)),), repeats=2, steady_warmup=0,
                 steady_repeats=2)  # fmt: skip
    for s in (*t.phases().values(), t.steady):
        assert not s.ok and s.error is not None and "during trace" in s.error
    assert t.first_over_steady is None


def test_new_shape_first_call_and_steady():
    first, steady = time_new_shape(
        lambda x: x * 2, (jnp.ones((4,)),), (jnp.ones((8,)),), repeats=2, steady_warmup=1,
        steady_repeats=2,
    )  # fmt: skip
    assert first.ok and len(first.times_s) == 2
    assert steady.ok and len(steady.times_s) == 2


def test_mlp_flops_counts_multiply_adds_as_two():
    # 8 -> 16 -> 8 at batch 2: 2 * 2 * (8*16 + 16*8)
    assert mlp_flops(batch=2, d_in=8, hidden=16, depth=2) == 2 * 2 * (8 * 16 + 16 * 8)
