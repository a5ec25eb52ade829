"""The pure functions the engine jits: prefill, insert, the loop, the cache-free path.

The cached decode step itself lives in :mod:`jaxlab.infer.fused`.

Each ``make_*`` closes over the static pieces (the model's ``graphdef``, the cache
capacity, the loop bound ``k``) and returns a function of array pytrees only, ready for
:class:`jaxlab.runtime.compiled.ShapeKeyedJit`. Nothing here touches the host.

Invariant shared with the model (``cache_mask``): the token at position ``p`` of a row
lives in cache slot ``p``, and a query at position ``p`` sees slots ``<= p``. Right-padded
prefill writes padding K/V beyond a row's length; those slots lie in the row's future, are
never visible, and are overwritten by the row's own decode writes before they could be.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlab.config.schema import ModelConfig
from jaxlab.infer.sampling import SamplingArrays, hits_stop, sample
from jaxlab.infer.state import DecodeState, NaiveState, from_model_cache
from jaxlab.model import KVCache, Transformer, apply, cache_mask, init_kv_cache
from jaxlab.model.layers import dense

Array = jax.Array

S = TypeVar("S", DecodeState, NaiveState)
P = TypeVar("P")

#: Marks "no token this step" in the ``[k, B]`` outputs of the decode loops.
NO_TOKEN = -1


def advance_rows(
    tok: Array, active: Array, generated: Array, done: Array, sp: SamplingArrays
) -> tuple[Array, Array]:
    """New ``(generated, done)`` after sampling ``tok`` on the ``active`` rows."""
    generated = jnp.where(active, generated + 1, generated)
    stopped = hits_stop(tok, sp) | (generated >= sp.max_new)
    return generated, done | (active & stopped)


# --------------------------------------------------------------------------- cached path


class Weights(NamedTuple):
    """What the cached entry points read: the model's ``params`` and its LM head as a
    ``[d_model, vocab]`` kernel (:func:`weights_for`)."""

    params: nnx.State
    head: Array


_transposed = jax.jit(jnp.transpose)


def weights_for(graphdef: nnx.GraphDef, params: nnx.State) -> Weights:
    """``params`` with the LM head laid out ``[d_model, vocab]`` for the decode matmuls.

    A tied head is the ``[vocab, d_model]`` embedding table, and logits are
    ``h @ table^T``. At the decode step's few rows XLA:CPU's dot over that layout (the
    contraction on the table's minor axis) ran 1.6x slower than over a ``[d_model, vocab]``
    copy at bench-small shapes (0.70 against 0.43 ms per head at one row), and the head is
    8.4 of the 21 MB a GPT-2-like step reads. So a tied model gets a transposed copy, made once
    here: ``vocab * d_model`` more memory, the same bytes read per step (the embedding
    lookup touches one row per token). An untied ``lm_head`` is already ``[d_model, vocab]``
    and is used as it is (no copy). Same math as ``Transformer.logits``: both operands in
    the compute dtype, f32 accumulation and result.
    """
    kernel, vocab_major = nnx.merge(graphdef, params).head_kernel()
    return Weights(params, _transposed(kernel) if vocab_major else kernel)


def step_weight_bytes(graphdef: nnx.GraphDef, weights: Weights) -> int:
    """Bytes of weights one cached decode step reads, whatever the batch: every block's
    parameters, the final norm and the LM head kernel.

    The token and position tables are left out: a step looks up one row of each per
    generated token (a tied head is read through its ``[d_model, vocab]`` copy, counted
    once as the head). At batch 1 a step can go no faster than one read of these bytes,
    which is what the ``peer`` benchmark's read ceiling divides by.
    """
    model = nnx.merge(graphdef, weights.params)
    arrays = [
        *jax.tree.leaves(nnx.state(model.blocks)),
        *jax.tree.leaves(nnx.state(model.final_norm)),
        weights.head,
    ]
    return sum(int(a.size) * a.dtype.itemsize for a in arrays)


def head_logits(model: Transformer, head: Array, h: Array) -> Array:
    """Final norm and LM head on features ``[..., d_model]`` -> f32 ``[..., vocab]``, with
    the head given as a ``[d_model, vocab]`` kernel (:class:`Weights`)."""
    return dense(model.final_norm(h), head, model.compute_dtype, jnp.float32)


def prefill_forward(
    model: Transformer, head: Array, tokens: Array, lengths: Array, cache: KVCache
) -> tuple[Array, KVCache]:
    """The model's cached forward over right-padded ``tokens [B, T]`` from slot 0, with the
    LM head applied only at each row's last real position: ``(f32[B, V], cache)``.

    Same blocks, masks and cache writes as ``Transformer.__call__`` (it calls the model's
    own ``Block``s); the only difference is that the final norm and head run on ``B`` rows
    instead of ``B * T`` (norm and head are per position, so the result is the same). The
    head is the largest matmul of a small model: at bench-small shapes and ``T = 32`` this
    is 32x less head work per prefill.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x, rope = model.embed_inputs(tokens, positions)
    mask = cache_mask(positions, cache.max_len)
    start = jnp.zeros((b,), jnp.int32)
    new_k: list[Array] = []
    new_v: list[Array] = []
    for i, block in enumerate(model.blocks):
        x, layer = block(x, mask, rope, (cache.k[i], cache.v[i]), start, None)
        assert layer is not None
        new_k.append(layer[0])
        new_v.append(layer[1])
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, d]
    return head_logits(model, head, last)[:, 0], KVCache(k=tuple(new_k), v=tuple(new_v))


def make_prefill(
    graphdef: nnx.GraphDef, model_cfg: ModelConfig, max_len: int, cache_dtype: jnp.dtype
) -> Callable[[Weights, Array, Array, SamplingArrays], DecodeState]:
    """``prefill(weights, tokens i32[B, T], lengths i32[B], sampling) -> DecodeState``.

    ``tokens`` are right-padded to the bucket length ``T``; row ``b`` is real up to
    ``lengths[b]``. The model's blocks fill a fresh ``[B, T]`` cache (:func:`prefill_forward`),
    which becomes the first ``T`` of ``max_len`` slots in the engine's layout, and the first
    token is sampled (``t = 0``) from the logits at ``lengths[b] - 1``.
    """

    def prefill(
        weights: Weights, tokens: Array, lengths: Array, sampling: SamplingArrays
    ) -> DecodeState:
        b = tokens.shape[0]
        model = nnx.merge(graphdef, weights.params)
        # A cache of the bucket's length, not max_len: prefill starts at slot 0, so its
        # queries can see no slot past the bucket. Attending over max_len slots would cost
        # max_len / T times the attention work and copies; the engine's layout gets the
        # rest of the slots as zeros when converting.
        cache = init_kv_cache(model_cfg, b, tokens.shape[1], cache_dtype)
        last, cache = prefill_forward(model, weights.head, tokens, lengths, cache)
        k, v = from_model_cache(cache, max_len)
        zeros = jnp.zeros((b,), jnp.int32)
        tok = sample(last, sampling, zeros)
        generated, done = advance_rows(tok, jnp.ones((b,), jnp.bool_), zeros, zeros > 0, sampling)
        return DecodeState(
            k=k,
            v=v,
            tokens=tok,
            pos=lengths.astype(jnp.int32),
            generated=generated,
            done=done,
            sampling=sampling,
        )

    return prefill


def decode_loop(
    step: Callable[[P, S], tuple[S, Array, Array]],
    params: P,
    state: S,
    k: int,
) -> tuple[S, Array, Array]:
    """Run ``step`` up to ``k`` times inside ``lax.while_loop``; stop when every row is done.

    Returns ``(state, tokens i32[k, B], done bool[B])``. ``done`` is a separate output
    buffer (not the state's), so it stays valid after the state is donated to the next
    call -- a caller may dispatch chunk ``i + 1`` before reading chunk ``i``'s flags.
    """
    b = state.done.shape[0]
    out = jnp.full((k, b), NO_TOKEN, jnp.int32)

    def cond(carry: tuple[Array, S, Array]) -> Array:
        i, st, _ = carry
        return (i < k) & ~jnp.all(st.done)

    def body(carry: tuple[Array, S, Array]) -> tuple[Array, S, Array]:
        i, st, buf = carry
        st, _, emitted = step(params, st)
        return i + 1, st, jax.lax.dynamic_update_index_in_dim(buf, emitted, i, axis=0)

    _, state, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, out))
    return state, out, state.done


def insert(prefix: DecodeState, state: DecodeState, slot: Array) -> DecodeState:
    """Copy the one-slot ``prefix`` into slot ``slot`` (an ``i32`` scalar) of ``state``:
    :func:`insert_rows` with one row (donate ``state``)."""
    return insert_rows(prefix, state, jnp.reshape(slot, (1,)))


def insert_rows(prefix: DecodeState, state: DecodeState, slots: Array) -> DecodeState:
    """Copy row ``i`` of the ``B``-row ``prefix`` into slot ``slots[i]`` of ``state``.

    ``slots: i32[B]``; a negative entry skips its row (a padding row of a batched prefill,
    or a request that finished in prefill). A scatter per field with ``mode="drop"``: the
    skipped rows get an out-of-range index, which the scatter drops, so no row of ``state``
    but the chosen ones changes. In place when ``state`` is donated; compiled once per
    ``B``. Slots must be distinct.
    """
    n = state.slots
    n_kv = prefix.k[0][0].shape[0] // prefix.slots
    idx = jnp.where(slots >= 0, slots, n)  # n is out of range -> dropped

    def put(big: Array, rows: Array, at: Array) -> Array:
        return big.at[at].set(rows.astype(big.dtype), mode="drop")

    fields = jax.tree.map(
        lambda big, rows: put(big, rows, idx),
        dataclasses.replace(state, k=(), v=()),
        dataclasses.replace(prefix, k=(), v=()),
    )
    # Cache rows of slot s are s * K .. s * K + K - 1; a dropped row's stay >= n * K.
    cache_idx = (idx[:, None] * n_kv + jnp.arange(n_kv, dtype=idx.dtype)[None, :]).reshape(-1)
    return dataclasses.replace(
        fields,
        k=jax.tree.map(lambda a, b: put(a, b, cache_idx), state.k, prefix.k),
        v=jax.tree.map(lambda a, b: put(a, b, cache_idx), state.v, prefix.v),
    )


# ---------------------------------------------------------------------------- naive path


def naive_step(
    graphdef: nnx.GraphDef, params: nnx.State, st: NaiveState
) -> tuple[NaiveState, Array, Array]:
    """One cache-free step: run the whole ``[B, max_len]`` buffer, read logits at ``pos``.

    The causal mask hides everything after ``pos`` (right padding, stale tokens), so the
    logits at ``pos`` are those of the prefix ``buf[:pos + 1]``.
    """
    b, s = st.buf.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, _ = apply(graphdef, params, st.buf, positions)
    logits = jnp.take_along_axis(logits, st.pos[:, None, None], axis=1)[:, 0]
    tok = sample(logits, st.sampling, st.generated)
    active = ~st.done
    generated, done = advance_rows(tok, active, st.generated, st.done, st.sampling)
    nxt = jnp.minimum(st.pos + 1, s - 1)
    cur = jnp.take_along_axis(st.buf, nxt[:, None], axis=1)[:, 0]
    row = jnp.arange(b)
    buf = st.buf.at[row, nxt].set(jnp.where(active, tok, cur))
    new = NaiveState(
        buf=buf,
        pos=jnp.where(active, nxt, st.pos),
        generated=generated,
        done=done,
        sampling=st.sampling,
    )
    return new, logits, jnp.where(active, tok, NO_TOKEN)


def make_naive_decode(
    graphdef: nnx.GraphDef, k: int
) -> Callable[[nnx.State, NaiveState], tuple[NaiveState, Array, Array]]:
    """``naive(params, state) -> (state, tokens i32[k, B], done)``: same loop, no cache."""

    def decode(params: nnx.State, state: NaiveState) -> tuple[NaiveState, Array, Array]:
        return decode_loop(functools.partial(naive_step, graphdef), params, state, k)

    return decode
