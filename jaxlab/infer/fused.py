"""The cached single-token decode step: the model's math, laid out for XLA:CPU's while loop.

Why not ``model.apply(..., kv_cache=...)`` for decode? Measured on the compiled HLO of the
decode loop (numbers in ``docs/inference.md``), the model's cached path costs, per layer and
per generated token, full copies of the cache:

* ``attend`` contracts ``q [B,1,K,G,D]`` with ``k [B,S,K,D]`` over the batch dims
  ``(b, k)``; XLA:CPU canonicalises that dot by transposing the cache to ``[B,K,S,D]``
  (and V to ``[B,K,D,S]``): two full-cache copies per layer per token;
* the cache write (``dynamic_update_slice``) feeds both the attention dot (through a
  reshape) and the loop output, so XLA duplicates it into two fusions that each
  materialise the cache, and copy insertion adds copies of the loop-carried buffer.

This module computes the same function for ``T = 1`` over the engine's cache layout
``[B * K, S, D]`` (kv-head major, see :mod:`jaxlab.infer.state`):

1. the attention dots have one batch dim ``n = b * K + j`` that is already the leading
   axis of the stored cache, so they read it in place (``[G, D] x [S, D]^T`` and
   ``[G, S] x [S, D]`` per ``n``) -- no transposes, no wasted FLOPs for MHA/GQA/MQA;
2. the write is one in-place scatter of ``K`` rows per slot whose result feeds the dots
   directly (no reshape between them), so nothing is duplicated or copied.

It reuses the model's own modules (norms, MLP, embeddings, RoPE, ``dense``), so only the
attention wiring is restated here; ``tests/infer`` checks it against ``model.apply``.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlab.infer.core import NO_TOKEN, advance_rows, decode_loop
from jaxlab.infer.sampling import sample
from jaxlab.infer.state import DecodeState, block_starts
from jaxlab.model import MASK_VALUE, Transformer, apply_rope
from jaxlab.model.layers import dense

Array = jax.Array


def write_rows(blocks: tuple[Array, ...], new: Array, pos: Array) -> tuple[Array, ...]:
    """Write ``new [B, K, D]`` at cache slot ``pos[b]`` of rows ``b*K+j`` of a blocked cache.

    One scatter per block; a row whose slot lies in another block gets an out-of-range
    index there, which ``mode="drop"`` skips. Indices are unique and sorted, so XLA writes
    in place on the donated buffers. The caller clamps ``pos`` into the cache.
    """
    b, kv, d = new.shape
    rows = jnp.arange(b * kv)
    cols = jnp.repeat(pos, kv)
    vals = new.reshape(b * kv, d)
    out = []
    for at, blk in zip(block_starts(tuple(x.shape[1] for x in blocks)), blocks, strict=True):
        n = blk.shape[1]
        local = jnp.where((cols >= at) & (cols < at + n), cols - at, n)
        out.append(
            blk.at[rows, local].set(
                vals.astype(blk.dtype), unique_indices=True, indices_are_sorted=True, mode="drop"
            )
        )
    return tuple(out)


def attend_one(q: Array, k: tuple[Array, ...], v: tuple[Array, ...], visible: Array) -> Array:
    """``q [B,H,D]`` over cache blocks ``k, v [B*K, block, D]``; ``visible [B, sum(block)]``.

    Returns ``[B,H,D]``. Same precision policy as :func:`jaxlab.model.attend`: K/V cast to
    ``q.dtype``, f32 logits and softmax, probabilities cast to the value dtype for the
    second matmul. Query head ``h`` uses kv head ``h // G`` (the model's grouping). Each
    block is its own dot (read in place); the logits are joined for one softmax.
    """
    b, h, d = q.shape
    n = k[0].shape[0]
    g = h * b // n
    qg = q.reshape(n, g, d)
    parts = [
        jnp.einsum("ngd,nsd->ngs", qg, kb.astype(q.dtype), preferred_element_type=jnp.float32)
        for kb in k
    ]
    logits = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    logits = logits * (1.0 / math.sqrt(d))
    mask = jnp.repeat(visible, n // b, axis=0)[:, None, :]  # [B*K, 1, S]
    logits = jnp.where(mask, logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
    cuts = list(itertools.accumulate(vb.shape[1] for vb in v[:-1]))
    outs = [
        jnp.einsum("ngs,nsd->ngd", p, vb.astype(q.dtype))
        for p, vb in zip(jnp.split(probs, cuts, axis=-1), v, strict=True)
    ]
    return functools.reduce(operator.add, outs).reshape(b, h, d)


def attend_prefix(q: Array, k: tuple[Array, ...], v: tuple[Array, ...], pos: Array) -> Array:
    """:func:`attend_one` over only the cache blocks that some row can see.

    At batch 16 on bench-small the K/V cache (33.5 MB) is as large as the weights, and the
    step is memory bound; a row at position ``p`` only sees slots ``<= p``. So the step
    reads the first ``c`` blocks, the fewest that hold ``max(pos) + 1`` slots (a
    ``lax.switch`` over ``c``); the blocks are separate buffers, so nothing is copied to
    read fewer of them. Slots past ``pos`` are masked in every branch, so the result
    equals attending over the whole cache.
    """
    sizes = tuple(x.shape[1] for x in k)
    ends = list(itertools.accumulate(sizes))
    slots = jnp.arange(ends[-1])[None, :]

    def first(c: int) -> Callable[[Array, tuple[Array, ...], tuple[Array, ...], Array], Array]:
        def attend_c(q: Array, k: tuple[Array, ...], v: tuple[Array, ...], pos: Array) -> Array:
            visible = slots[:, : ends[c - 1]] <= pos[:, None]
            return attend_one(q, k[:c], v[:c], visible)

        return attend_c

    if len(sizes) == 1:
        return first(1)(q, k, v, pos)
    need = jnp.max(pos) + 1
    index = jnp.sum(jnp.asarray(ends[:-1]) < need)
    return jax.lax.switch(index, [first(c) for c in range(1, len(sizes) + 1)], q, k, v, pos)


def fused_forward(
    model: Transformer,
    tokens: Array,
    pos: Array,
    k_cache: tuple[tuple[Array, ...], ...],
    v_cache: tuple[tuple[Array, ...], ...],
) -> tuple[Array, tuple[tuple[Array, ...], ...], tuple[tuple[Array, ...], ...]]:
    """Logits ``f32[B, V]`` of one new token per row at ``pos``, and the updated caches.

    Equal to ``model(tokens[:, None], pos[:, None], kv_cache=..., cache_index=pos)``
    (in the model's layout) up to float summation order.
    """
    b = tokens.shape[0]
    x, rope = model.embed_inputs(tokens[:, None], pos[:, None])  # x: f32 [B, 1, d]
    new_k: list[tuple[Array, ...]] = []
    new_v: list[tuple[Array, ...]] = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        h, kv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
        qkv = dense(block.attn_norm(x), attn.w_qkv[...], attn.compute_dtype)
        qkv = qkv.reshape(b, 1, h + 2 * kv, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
        if rope is not None:
            q = apply_rope(q, *rope)
            k = apply_rope(k, *rope)
        kc = write_rows(k_cache[i], k[:, 0], pos)
        vc = write_rows(v_cache[i], v[:, 0], pos)
        new_k.append(kc)
        new_v.append(vc)
        out = attend_prefix(q[:, 0], kc, vc, pos).reshape(b, 1, h * d)
        x = x + dense(out, attn.w_out[...], attn.compute_dtype, jnp.float32)
        x = x + block.mlp(block.mlp_norm(x))
    return model.logits(model.final_norm(x))[:, 0], tuple(new_k), tuple(new_v)


def decode_step(
    graphdef: nnx.GraphDef, params: nnx.State, st: DecodeState
) -> tuple[DecodeState, Array, Array]:
    """One cached step for every row: ``(new state, logits f32[B, V], emitted i32[B])``.

    Feeds ``st.tokens`` at ``st.pos`` (writing its K/V to cache slot ``pos``), samples the
    next token with key index ``st.generated``. Done rows compute but do not advance (their
    position is clamped into the cache); their ``emitted`` is :data:`NO_TOKEN`.
    """
    model = nnx.merge(graphdef, params)
    pos = jnp.minimum(st.pos, st.max_len - 1)
    logits, k, v = fused_forward(model, st.tokens, pos, st.k, st.v)
    tok = sample(logits, st.sampling, st.generated)
    active = ~st.done
    generated, done = advance_rows(tok, active, st.generated, st.done, st.sampling)
    new = DecodeState(
        k=k,
        v=v,
        tokens=jnp.where(active, tok, st.tokens),
        pos=jnp.where(active, st.pos + 1, st.pos),
        generated=generated,
        done=done,
        sampling=st.sampling,
    )
    return new, logits, jnp.where(active, tok, NO_TOKEN)


def make_decode(
    graphdef: nnx.GraphDef, k: int
) -> Callable[[nnx.State, DecodeState], tuple[DecodeState, Array, Array]]:
    """``decode(params, state) -> (state, tokens i32[k, B], done bool[B])``: <= ``k`` steps.

    One ``lax.while_loop`` inside the jitted function; it exits early once every row is
    done, and unfilled entries are :data:`NO_TOKEN`. Jit it with the state donated so the
    cache is updated in place.
    """
    step = functools.partial(decode_step, graphdef)

    def decode(params: nnx.State, state: DecodeState) -> tuple[DecodeState, Array, Array]:
        return decode_loop(step, params, state, k)

    return decode
