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
   directly (no reshape between them), so nothing is duplicated or copied;
3. only the leading rows up to the last active slot are computed (:func:`row_buckets`):
   a slot that is idle or done costs nothing unless a busier slot sits above it.

It reuses the model's own modules (norms, MLP, embeddings, RoPE, ``dense``), so only the
attention wiring is restated here; ``tests/infer`` checks it against ``model.apply``.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlab.infer.core import NO_TOKEN, Weights, advance_rows, decode_loop, head_logits
from jaxlab.infer.sampling import SamplingArrays, sample
from jaxlab.infer.state import DecodeState, block_starts
from jaxlab.model import MASK_VALUE, Transformer, apply_rope
from jaxlab.model.layers import dense
from jaxlab.model.reduce import softmax_last
from jaxlab.model.transformer import Block

Array = jax.Array


def write_rows(blocks: tuple[Array, ...], new: Array, pos: Array) -> tuple[Array, ...]:
    """Write ``new [B, K, D]`` at cache slot ``pos[b]`` of rows ``b*K+j`` of a blocked cache.

    One scatter per block; a row whose slot lies in another block gets an out-of-range
    index there, which ``mode="drop"`` skips. Indices are unique and sorted, so XLA writes
    in place on the donated buffers. The caller clamps ``pos`` into the cache; a row at
    ``pos >= max_len`` writes nothing (a row the step did not compute).
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
    probs = softmax_last(logits).astype(q.dtype)
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


Caches = tuple[tuple[Array, ...], ...]

#: Row buckets of the decode step are powers of this below the slot count (16 -> 1, 4, 16).
ROW_BUCKET_BASE = 4


def row_buckets(slots: int) -> tuple[int, ...]:
    """How many leading rows a decode step may compute: ``(1, 4, 16)`` for 16 slots.

    Rows past the last active one are idle or done slots, and the step skips them, so one
    request on a 16-slot server pays for a 1-row step, not a 16-row one. Each bucket is one
    more branch in the compiled step: compile time grows with the number of buckets, the
    number of compiled functions does not.
    """
    out: list[int] = []
    r = 1
    while r < slots:
        out.append(r)
        r *= ROW_BUCKET_BASE
    return (*out, slots)


def by_rows(
    index: Array | None, buckets: tuple[int, ...], f: Callable[..., tuple[Array, ...]], *args: Any
) -> tuple[Array, ...]:
    """``f(r, *args)`` for ``r = buckets[index]`` leading rows (a ``lax.switch``), each
    output zero-padded back to ``buckets[-1]`` rows. ``f`` slices its row-indexed inputs
    itself. Without ``index`` there is no switch: ``f`` runs on all rows.
    """
    n = buckets[-1]
    if index is None:
        return f(n, *args)

    def branch(r: int) -> Callable[..., tuple[Array, ...]]:
        def run(*a: Any) -> tuple[Array, ...]:
            return tuple(jnp.pad(o, [(0, n - r)] + [(0, 0)] * (o.ndim - 1)) for o in f(r, *a))

        return run

    return tuple(jax.lax.switch(index, [branch(r) for r in buckets], *args))


def _project(
    block: Block, r: int, x: Array, rope: tuple[Array, Array] | None
) -> tuple[Array, Array, Array]:
    """Rows ``:r`` of ``x [B, 1, d]`` -> ``q [r, H, D]``, ``k, v [r, K, D]`` (RoPE applied)."""
    a = block.attn
    h, kv, d = a.n_heads, a.n_kv_heads, a.head_dim
    qkv = dense(block.attn_norm(x[:r]), a.w_qkv[...], a.compute_dtype).reshape(r, 1, -1, d)
    q, k, v = qkv[:, :, :h], qkv[:, :, h : h + kv], qkv[:, :, h + kv :]
    if rope is not None:
        sin, cos = (t[:r] for t in rope)
        q = apply_rope(q, sin, cos)
        k = apply_rope(k, sin, cos)
    return q[:, 0], k[:, 0], v[:, 0]


def _attend_mlp(
    block: Block,
    r: int,
    x: Array,
    q: Array,
    k: tuple[Array, ...],
    v: tuple[Array, ...],
    pos: Array,
) -> tuple[Array]:
    """The rest of the block for rows ``:r``: attention over the (written) cache, MLP."""
    a = block.attn
    n_rows = r * a.n_kv_heads
    if n_rows < k[0].shape[0]:  # the first r slots' rows of each block: a small copy
        k = tuple(blk[:n_rows] for blk in k)
        v = tuple(blk[:n_rows] for blk in v)
    out = attend_prefix(q[:r], k, v, pos[:r]).reshape(r, 1, a.n_heads * a.head_dim)
    y = x[:r] + dense(out, a.w_out[...], a.compute_dtype, jnp.float32)
    return (y + block.mlp(block.mlp_norm(y)),)


def fused_forward(
    model: Transformer,
    tokens: Array,
    pos: Array,
    k_cache: Caches,
    v_cache: Caches,
    index: Array | None = None,
    buckets: tuple[int, ...] | None = None,
) -> tuple[Array, Caches, Caches]:
    """The last block's output ``f32[B, 1, d]`` for one new token per row at ``pos``, and
    the updated caches (the head is the caller's, :func:`decode_step`).

    Equal to the hidden state of ``model(tokens[:, None], pos[:, None], kv_cache=...,
    cache_index=pos)`` (in the model's layout) up to float summation order. With
    ``index`` into ``buckets`` (:func:`row_buckets`) only the first ``buckets[index]``
    rows are computed: each layer's row-sized work runs in two :func:`by_rows` switches
    (the QKV projection; attention and MLP), and the rows past them write no K/V and come
    out as zeros. The cache writes sit between the two switches, outside both, so they
    update the donated buffers in place and feed the attention dots directly.
    """
    b = tokens.shape[0]
    buckets = buckets or (b,)
    pos_w = pos
    if index is not None:  # rows not computed write nothing: a slot the scatter drops
        capacity = sum(blk.shape[1] for blk in k_cache[0])
        pos_w = jnp.where(jnp.arange(b) < jnp.asarray(buckets)[index], pos, capacity)
    x, rope = model.embed_inputs(tokens[:, None], pos[:, None])  # x: f32 [B, 1, d]
    new_k: list[tuple[Array, ...]] = []
    new_v: list[tuple[Array, ...]] = []
    for i, block in enumerate(model.blocks):
        q, k, v = by_rows(index, buckets, functools.partial(_project, block), x, rope)
        kc = write_rows(k_cache[i], k, pos_w)
        vc = write_rows(v_cache[i], v, pos_w)
        new_k.append(kc)
        new_v.append(vc)
        (x,) = by_rows(index, buckets, functools.partial(_attend_mlp, block), x, q, kc, vc, pos)
    return x, tuple(new_k), tuple(new_v)


def decode_step(
    graphdef: nnx.GraphDef, weights: Weights, st: DecodeState
) -> tuple[DecodeState, Array, Array]:
    """One cached step for every row: ``(new state, logits f32[B, V], emitted i32[B])``.

    Feeds ``st.tokens`` at ``st.pos`` (writing its K/V to cache slot ``pos``), samples the
    next token with key index ``st.generated``. Only the leading rows up to the last
    active one are computed, rounded up to a :func:`row_buckets` size; done rows inside
    that range compute but do not advance (their position is clamped into the cache), and
    rows past it get zero logits. Every done row's ``emitted`` is :data:`NO_TOKEN`.
    ``weights`` carries the LM head as a ``[d_model, vocab]`` kernel (:func:`weights_for`).
    """
    model = nnx.merge(graphdef, weights.params)
    n = st.slots
    pos = jnp.minimum(st.pos, st.max_len - 1)
    active = ~st.done
    buckets = row_buckets(n)
    index = None
    if len(buckets) > 1:
        last = jnp.max(jnp.where(active, jnp.arange(1, n + 1), 0))  # 1 + last active row
        index = jnp.sum(jnp.asarray(buckets[:-1]) < last)
    x, k, v = fused_forward(model, st.tokens, pos, st.k, st.v, index, buckets)

    def head(r: int, x: Array, sp: SamplingArrays, generated: Array) -> tuple[Array, Array]:
        logits = head_logits(model, weights.head, x[:r])[:, 0]
        return logits, sample(logits, jax.tree.map(lambda a: a[:r], sp), generated[:r])

    logits, tok = by_rows(index, buckets, head, x, st.sampling, st.generated)
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
) -> Callable[[Weights, DecodeState], tuple[DecodeState, Array, Array]]:
    """``decode(weights, state) -> (state, tokens i32[k, B], done bool[B])``: <= ``k`` steps.

    One ``lax.while_loop`` inside the jitted function; it exits early once every row is
    done, and unfilled entries are :data:`NO_TOKEN`. Jit it with the state donated so the
    cache is updated in place.
    """
    step = functools.partial(decode_step, graphdef)

    def decode(weights: Weights, state: DecodeState) -> tuple[DecodeState, Array, Array]:
        return decode_loop(step, weights, state, k)

    return decode
