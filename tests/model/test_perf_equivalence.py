"""The performance rewrites compute what the plain code computes (docs/performance.md).

* the fused, chunked LM head + cross-entropy (``jaxlab.model.loss``) equals the plain
  ``logits -> logsumexp - logit[target]`` computation in value, correct-count and
  gradients (h, kernel, mask), tied and untied, with padding and uneven chunks;
* ``token_losses`` (which uses it) equals the plain logits-based loss of the model, and
  its parameter gradients equal those of the plain loss;
* ``dense`` (flattened to 2-D) equals the batched matmul (the causal halves of the
  ``xla_cpu`` attention kernel are checked against the reference in ``tests/kernels``);
* the XLA:CPU flag defaults respect the user's own ``XLA_FLAGS``, are chosen by CPU vendor,
  and put the dots on the kernels they claim to.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlab.config import load_config
from jaxlab.model import apply, dense, make_model, split_model
from jaxlab.model.loss import head_cross_entropy
from jaxlab.runtime.platform import (
    XLA_CPU_DEFAULTS_BY_VENDOR,
    apply_xla_cpu_defaults,
    xla_cpu_defaults,
)
from jaxlab.train.step import token_losses


def plain_ce(h, w, targets, mask, vocab_major):
    """The reference: full logits, ``logsumexp - logit[target]``, ``argmax == target``."""
    eq = "...d,vd->...v" if vocab_major else "...d,dv->...v"
    logits = jnp.einsum(eq, h, w, preferred_element_type=jnp.float32)
    tl = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - tl
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * mask
    return jnp.sum(ce * mask), jnp.sum(correct)


def data(seed, b, t, d, v, vocab_major):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    shape = (v, d) if vocab_major else (d, v)
    w = jnp.asarray(rng.standard_normal(shape) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray((rng.random((b, t)) > 0.25).astype(np.float32))
    return h, w, targets, mask


def value_and_grads(fn, h, w, targets, mask):
    def f(h, w, mask):
        return fn(h, w, targets, mask)

    (loss, correct), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
        h, w, mask
    )
    return loss, correct, grads


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize(
    ("b", "t", "chunk"),
    [
        (2, 24, 16),  # 8 positions per chunk: 3 chunks
        (3, 10, 12),  # 4 positions per chunk: T padded from 10 to 12
        (2, 7, 1000),  # one chunk (chunk larger than the batch)
        (1, 5, 1),  # one token per chunk
    ],
)
def test_fused_head_ce_equals_plain(vocab_major, b, t, chunk):
    h, w, targets, mask = data(0, b, t, 16, 37, vocab_major)

    def fused(h, w, targets, mask):
        return head_cross_entropy(h, w, targets, mask, vocab_major=vocab_major, chunk=chunk)

    def plain(h, w, targets, mask):
        return plain_ce(h, w, targets, mask, vocab_major)

    loss, correct, grads = value_and_grads(fused, h, w, targets, mask)
    ref_loss, ref_correct, ref_grads = value_and_grads(plain, h, w, targets, mask)
    # Stated tolerance: f32 summation order differs (per-chunk partial sums).
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert float(correct) == float(ref_correct)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_fused_head_ce_flat_tokens_and_without_differentiation():
    h, w, targets, mask = data(1, 2, 12, 8, 29, True)
    flat = head_cross_entropy(
        h.reshape(-1, 8), w, targets.reshape(-1), mask.reshape(-1), vocab_major=True, chunk=5
    )
    batched = jax.jit(lambda h, w, t, m: head_cross_entropy(h, w, t, m, vocab_major=True, chunk=5))(
        h, w, targets, mask
    )
    ref = plain_ce(h, w, targets, mask, True)
    for got in (flat, batched):
        np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
        assert float(got[1]) == float(ref[1])


def test_correct_count_breaks_ties_like_argmax():
    """Duplicated vocabulary rows give exactly tied logits: argmax takes the first index."""
    rng = np.random.default_rng(2)
    d, v = 8, 12
    w = rng.standard_normal((v, d)).astype(np.float32)
    w[7] = w[3]  # ids 3 and 7 always tie
    w[9] = w[3]
    h = jnp.asarray(rng.standard_normal((1, 40, d)), jnp.float32)
    w = jnp.asarray(w)
    logits = np.asarray(jnp.einsum("btd,vd->btv", h, w))
    am = logits.argmax(-1)
    # targets: the argmax itself, or a tied later id, or something else
    targets = np.where(np.arange(40) % 3 == 0, am, np.where(am == 3, 7, (am + 1) % v))
    targets = jnp.asarray(targets, jnp.int32)
    mask = jnp.ones((1, 40), jnp.float32)
    _, correct = head_cross_entropy(h, w, targets, mask, vocab_major=True, chunk=7)
    _, ref = plain_ce(h, w, targets, mask, True)
    assert float(correct) == float(ref)


@pytest.mark.parametrize(
    ("tied", "chunk"),
    [
        (True, 256),  # train.loss_chunk_tokens's default: one block of every token here
        (False, 256),
        (True, 6),  # 2 positions of the 3 rows per block: 10 blocks
        (False, 15),  # 5 positions per block: 4 blocks
    ],
)
def test_token_losses_equal_plain_logits_loss(tied, chunk):
    cfg = load_config(
        "tiny",
        [
            "model.vocab_size=263",
            "tokenizer.kind=byte",
            f"model.tie_embeddings={str(tied).lower()}",
        ],
        environ={},
    )
    model = make_model(cfg.model, cfg.train.precision, seed=0)
    graphdef, params = split_model(model)
    rng = np.random.default_rng(3)
    b, t = 3, 20
    toks = rng.integers(0, 263, (b, t + 1))
    seg = np.ones((b, t), np.int32)
    seg[1, 9:] = 2  # a packed row: two documents
    batch = {
        "tokens": jnp.asarray(toks[:, :-1], jnp.int32),
        "targets": jnp.asarray(toks[:, 1:], jnp.int32),
        "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray((rng.random((b, t)) > 0.2).astype(np.float32)),
    }

    def plain(params):
        logits = apply(
            graphdef, params, batch["tokens"], batch["positions"], segment_ids=batch["segment_ids"]
        )
        mask = batch["loss_mask"]
        total, correct = plain_ce_from_logits(logits, batch["targets"], mask)
        return total, (jnp.sum(mask), correct)

    def fused(params):
        total, n, correct = token_losses(graphdef, params, batch, None, loss_chunk_tokens=chunk)
        return total, (n, correct)

    (lf, (nf, cf)), gf = jax.jit(jax.value_and_grad(fused, has_aux=True))(params)
    (lp, (np_, cp)), gp = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    np.testing.assert_allclose(float(lf), float(lp), rtol=1e-5)
    assert float(nf) == float(np_) and float(cf) == float(cp)
    for a, b_ in zip(jax.tree.leaves(gf), jax.tree.leaves(gp), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-6)


def plain_ce_from_logits(logits, targets, mask):
    tl = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - tl
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * mask
    return jnp.sum(ce * mask), jnp.sum(correct)


def test_dense_flattens_without_changing_the_result():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
    got = dense(x, k, jnp.float32)
    assert got.shape == (2, 3, 5, 6)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(k), rtol=1e-5)
    assert dense(x[0, 0, 0], k, jnp.float32).shape == (6,)


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])
def test_xla_cpu_defaults_respect_user_flags(vendor):
    (name, value), *_ = xla_cpu_defaults(vendor).items()
    env: dict[str, str] = {}
    assert apply_xla_cpu_defaults(env, vendor) == [f"--{name}={value}"]
    assert env["XLA_FLAGS"] == f"--{name}={value}"
    assert apply_xla_cpu_defaults(env, vendor) == []  # idempotent
    mine = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 --{name}=foo"}
    assert apply_xla_cpu_defaults(mine, vendor) == []
    assert mine["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 --{name}=foo"
    other = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    apply_xla_cpu_defaults(other, vendor)
    assert other["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=2",
        f"--{name}={value}",
    ]
    off = {"JAXLAB_XLA_CPU_DEFAULTS": "0"}
    assert apply_xla_cpu_defaults(off, vendor) == [] and "XLA_FLAGS" not in off


def test_xla_cpu_defaults_by_vendor():
    amd = XLA_CPU_DEFAULTS_BY_VENDOR["AuthenticAMD"]
    assert xla_cpu_defaults("AuthenticAMD") == amd
    assert xla_cpu_defaults("GenuineIntel") == {"xla_cpu_experimental_ynn_fusion_type": ""}
    assert xla_cpu_defaults("") == amd and xla_cpu_defaults("HygonGenuine") == amd


_YNN_PROBE = """
import jax, jax.numpy as jnp
f = jax.jit(lambda x, w: jnp.sum(x @ w, axis=-1))
hlo = f.lower(jnp.ones((16, 256)), jnp.ones((256, 1024))).compile().as_text()
print("ynn" if "__ynn_fusion" in hlo else "xla")
"""


@pytest.mark.parametrize(("vendor", "dot"), [("AuthenticAMD", "ynn"), ("GenuineIntel", "xla")])
def test_xla_cpu_defaults_pick_the_dot_kernels_they_claim(vendor, dot):
    """Each vendor's flags, handed to a fresh XLA:CPU, run the dot where the comments in
    ``jaxlab.runtime.platform`` say: on YNNPACK (AMD) or on XLA's own kernels (Intel). A
    jaxlib that renamed or reinterpreted the flag would fail here, not silently slow down."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    apply_xla_cpu_defaults(env, vendor)
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _YNN_PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-1] == dot
