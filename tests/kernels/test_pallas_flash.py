"""The Pallas flash kernel equals the reference kernel (CPU, Pallas interpret mode).

* The plan's tile tables are exactly the tiles holding a visible (query, key) pair, in
  the order each kernel accumulates in (pure NumPy, many examples).
* Forward output and ``dq, dk, dv`` (the VJP of a random cotangent) equal the reference
  kernel's, hypothesis choosing batch, length (rarely a multiple of a tile), query/kv
  head groups, head_dim, tile sizes (forward and backward apart), segment ids (none,
  packed documents, arbitrary ids) and dtype.
* One train step of a tiny model with ``attention_impl="pallas"`` equals the reference
  kernel's step.

Tolerances, and why:

* **float32**: both sides compute in f32 and differ only in summation order (tile by
  tile with a running max here, one softmax there). Each output sums at most ``T`` terms,
  so the difference is at most ``T * eps_f32`` of the largest value (3.6e-5 at T = 300)
  and in practice ``sqrt(T) * eps_f32``; we allow 2e-5 of the largest value.
* **bfloat16**: the inputs are bf16, but the kernel and the reference round different
  intermediates to bf16 (unnormalised vs normalised probabilities, ``ds`` vs ``dp``), so
  comparing the two bf16 results to each other would test their rounding, not the kernel.
  Both are compared to the same math in f32 on the same (bf16-exact) inputs instead. The
  kernel rounds twice on any path (a probability or ``ds`` before a matmul, the result
  after it), each by at most u = 2^-8 relative: with sums of mixed signs in the gradients
  that bound is ``2u`` of the largest value, and we allow ``4u`` (1.6%). The reference
  kernel's own bf16 results are held to the same bound, so the tolerance is not loose
  for this kernel alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxlab.kernels import KERNELS
from jaxlab.kernels.flash_plan import BlockSizes, FlashPlan, padded_length, plans
from jaxlab.kernels.pallas_flash import flash_attention

REF = KERNELS["reference"]
BF16_U = 2.0**-8


# ------------------------------------------------------------------------ the plan


def visible_tiles(length: int, bq: int, bk: int) -> set[tuple[int, int]]:
    """Tiles holding a pair (query q < length, key k <= q): by brute force."""
    out = set()
    for q in range(length):
        for k in range(q + 1):
            out.add((q // bq, k // bk))
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    length=st.integers(1, 700),
    blocks=st.tuples(st.sampled_from([128, 256, 384, 512]), st.sampled_from([128, 256, 512])),
)
def test_the_plan_walks_exactly_the_visible_tiles(length: int, blocks: tuple[int, int]) -> None:
    fwd, _ = plans(length, BlockSizes(*blocks))
    assert fwd.padded >= length and fwd.padded % fwd.bq == 0 and fwd.padded % fwd.bk == 0
    want = visible_tiles(length, fwd.bq, fwd.bk)
    qi, ki = fwd.q_major()
    assert list(zip(qi.tolist(), ki.tolist(), strict=True)) == sorted(want)
    qi, ki = fwd.k_major()
    assert list(zip(ki.tolist(), qi.tolist(), strict=True)) == sorted((k, q) for q, k in want)


def test_tiles_are_clamped_to_short_sequences_and_pad_to_every_tile() -> None:
    fwd, bwd = plans(10, BlockSizes(512, 512))
    assert (fwd.bq, fwd.bk, fwd.padded) == (128, 128, 128)
    fwd, bwd = plans(300, BlockSizes(128, 256, 1024, 128))
    assert (fwd.bq, fwd.bk, bwd.bq, bwd.bk) == (128, 256, 512, 128)  # 1024 clamped to 512
    assert fwd.padded == bwd.padded == padded_length(300, BlockSizes(128, 256, 1024, 128)) == 512
    assert (
        plans(1000, BlockSizes(384, 256))[0].padded == 1536
    )  # lcm(384, 256): powers of 2 pad less
    assert FlashPlan(300, 512, 128, 256).q_blocks == 3  # the fourth block is padding only


@pytest.mark.parametrize("bad", [0, 64, 200, -128])
def test_tile_sizes_must_be_whole_lanes(bad: int) -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        BlockSizes(q=bad)
    with pytest.raises(ValueError, match="k_bwd"):
        BlockSizes(k_bwd=bad)


def test_bad_shapes_are_refused() -> None:
    q, kv = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 3, 16))
    with pytest.raises(ValueError, match="do not split"):
        flash_attention(q, kv, kv)
    with pytest.raises(ValueError, match="k and v must be"):
        flash_attention(q, jnp.zeros((1, 9, 2, 16)), jnp.zeros((1, 9, 2, 16)))
    with pytest.raises(ValueError, match="segment_ids must be"):
        flash_attention(q, q[:, :, :2], q[:, :, :2], jnp.zeros((1, 7), jnp.int32))


# ------------------------------------------------------------- against the reference


def segment_ids(kind: str, b: int, t: int, rng: np.random.Generator) -> jax.Array | None:
    if kind == "none":
        return None
    if kind == "packed":  # documents one after another: ids rise along the row
        return jnp.asarray(np.cumsum(rng.random((b, t)) < 8 / t, axis=1), jnp.int32)
    return jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)  # any ids: the mask is equality


def out_and_grads(attend, q, k, v, seg, ct):
    out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
    return (out, *pullback(ct))


@functools.cache
def program(name: str, blocks: tuple[int, ...] | None):
    if name == "reference":
        return jax.jit(functools.partial(out_and_grads, REF.attend))
    sizes = BlockSizes(*blocks) if blocks else None

    def attend(q, k, v, seg):
        return flash_attention(q, k, v, seg, block_sizes=sizes)

    return jax.jit(functools.partial(out_and_grads, attend))


def assert_within(got, want, tol: float, what: str) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(float(np.max(np.abs(want))), 1.0)
    err = float(np.max(np.abs(got - want)))
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol:.3g} x {scale:.3g}"


BLOCKS = [(128, 128), (256, 128), (128, 256, 256, 128)]


@settings(max_examples=5, deadline=None, derandomize=True)
@example(  # forward tiles smaller than backward ones: padding rows the forward never ran
    batch=1, length=300, heads=(4, 1), head_dim=32, dtype="bfloat16",
    blocks=(128, 256, 256, 128), segments="packed", seed=1,
)  # fmt: skip
@example(
    batch=2, length=200, heads=(4, 2), head_dim=64, dtype="float32",
    blocks=(128, 128), segments="random", seed=2,
)  # fmt: skip
@example(
    batch=1, length=1, heads=(2, 2), head_dim=32, dtype="float32",
    blocks=(128, 128), segments="none", seed=3,
)  # fmt: skip
@given(
    batch=st.integers(1, 2),
    length=st.sampled_from([5, 64, 129, 200, 300]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([32, 64]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    blocks=st.sampled_from(BLOCKS),
    segments=st.sampled_from(["none", "packed", "random"]),
    seed=st.integers(0, 2**16),
)
def test_output_and_gradients_equal_the_reference(
    batch, length, heads, head_dim, dtype, blocks, segments, seed
) -> None:
    """Forward output, then dq, dk, dv of ``sum(out * cotangent)``."""
    h, kv = heads
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    q, ct = normal(batch, length, h, head_dim), normal(batch, length, h, head_dim)
    k, v = normal(batch, length, kv, head_dim), normal(batch, length, kv, head_dim)
    seg = segment_ids(segments, batch, length, rng)
    got = program("pallas", blocks)(q, k, v, seg, ct)
    assert got[0].shape == q.shape and got[0].dtype == q.dtype
    assert [g.dtype for g in got[1:]] == [q.dtype, k.dtype, v.dtype]
    names = ("output", "dq", "dk", "dv")
    if dtype == "float32":
        want = program("reference", None)(q, k, v, seg, ct)
        for name, a, b in zip(names, got, want, strict=True):
            assert_within(a, b, 2e-5, name)
        return
    up = [x.astype(jnp.float32) for x in (q, k, v, ct)]
    truth = program("reference", None)(*up[:3], seg, up[3])
    theirs = program("reference", None)(q, k, v, seg, ct)
    for name, a, b, c in zip(names, got, truth, theirs, strict=True):
        assert_within(a, b, 4 * BF16_U, name)
        assert_within(c, b, 4 * BF16_U, f"reference {name}")


def test_interpret_mode_is_chosen_on_the_cpu() -> None:
    """Without ``interpret`` the kernel runs here (CPU: interpret mode); asking for the
    compiled Mosaic kernel on the CPU fails, so the automatic choice is what CI relies on."""
    assert jax.default_backend() == "cpu"
    q = jnp.ones((1, 4, 1, 32))
    np.testing.assert_allclose(np.asarray(flash_attention(q, q, q)), np.ones((1, 4, 1, 32)))
    with pytest.raises(Exception, match=r"(?i)interpret|tpu|mosaic"):
        jax.block_until_ready(flash_attention(q, q, q, interpret=False))


# ------------------------------------------------------------------------ the model


def test_one_train_step_with_pallas_equals_the_reference_step() -> None:
    """A tiny GQA model, packed documents: loss, gradient norm and every updated parameter."""
    from jaxlab.config import load_config
    from jaxlab.model import make_model, split_model
    from jaxlab.train.optimizer import learning_rate_schedule, make_optimizer
    from jaxlab.train.step import init_state, make_train_step

    rng = np.random.default_rng(0)
    b, t = 4, 48
    tokens = rng.integers(0, 258, (b, t + 1))
    cuts = np.cumsum(rng.random((b, t)) < 0.08, axis=1)  # packed documents
    starts = np.concatenate([np.ones((b, 1), bool), cuts[:, 1:] != cuts[:, :-1]], axis=1)
    positions = np.zeros((b, t), np.int32)
    for row in range(b):
        for i in range(1, t):
            positions[row, i] = 0 if starts[row, i] else positions[row, i - 1] + 1
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1], jnp.int32),
        "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
        "positions": jnp.asarray(positions),
        "segment_ids": jnp.asarray(cuts, jnp.int32),
        "loss_mask": jnp.ones((b, t), jnp.float32),
    }
    results = {}
    for impl in ("reference", "pallas"):
        cfg = load_config(
            "tiny",
            ["model.vocab_size=258", "tokenizer.kind=byte", "model.n_kv_heads=2", "model.n_layers=1",
             f"model.attention_impl={impl}"],
            environ={},
        )  # fmt: skip
        graphdef, params = split_model(make_model(cfg.model, cfg.train.precision, seed=0))
        tx = make_optimizer(cfg.train)
        step = jax.jit(
            make_train_step(
                graphdef, tx, learning_rate_schedule(cfg.train), grad_accum_steps=1, dropout=False
            )
        )
        results[impl] = step(init_state(params, tx, 0), batch)
    (ref_state, ref_m), (state, m) = results["reference"], results["pallas"]
    np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m["grad_norm"]), float(ref_m["grad_norm"]), rtol=1e-5)
    for x, y in zip(
        jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"]), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
