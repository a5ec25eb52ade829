"""The pure functions the engine jits: prefill and its first token, the decode step and
loop, insert.

Each ``make_*`` closes over the static pieces (the model's ``graphdef``, the cache
capacity, the loop bound ``k``) and returns a function of array pytrees only, ready for
:class:`jaxlab.runtime.compiled.ShapeKeyedJit`. Nothing here touches the host. The model
does the forward passes over the paged cache (:meth:`~jaxlab.model.Transformer.prefill_pages`,
:meth:`~jaxlab.model.Transformer.extend` and :meth:`~jaxlab.model.Transformer.decode`);
these functions add sampling and the per-row bookkeeping of
:class:`~jaxlab.infer.state.DecodeState`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxlab.infer.sampling import SamplingArrays, hits_stop, sample
from jaxlab.infer.state import DecodeState
from jaxlab.kernels import NO_SLOT
from jaxlab.kernels.paged import PagedCache, Pages
from jaxlab.kernels.rows import Rows, row_buckets
from jaxlab.model import lora as lora_math
from jaxlab.model.quant import (
    Activations,
    QuantizedKernel,
    quantize_dense,
    quantize_tied_head,
    weight_bytes,
)
from jaxlab.model.transformer import C, Cache, Transformer

Array = jax.Array
S = TypeVar("S")
P = TypeVar("P")

#: Marks "no token this step" in the ``[k, B]`` outputs of the decode loops.
NO_TOKEN = -1


class Adapters(NamedTuple):
    """The LoRA adapters an engine serves, stacked (:func:`jaxlab.model.lora.stack`):
    ``weights {proj: {"a": [L, N, in, R], "b": [L, N, R, out]}}`` and ``scale f32[N]``, slot
    :data:`~jaxlab.model.lora.NO_ADAPTER` all zeros (the base model)."""

    weights: lora_math.Weights
    scale: Array

    @property
    def count(self) -> int:
        """Adapter slots, the all-zero slot 0 included."""
        return int(self.scale.shape[0])


class Weights(NamedTuple):
    r"""What prefill and decode read: the model's ``params``, and its LM head as a
    ``[d_model, vocab]`` kernel prepared once for decoding (None: the model's own). With
    int8 weights the dense kernels in ``params`` and the head are
    :class:`~jaxlab.model.quant.QuantizedKernel`\ s. ``adapters``: the LoRA adapters the
    rows choose from by id (None: the base model alone)."""

    params: nnx.State
    head: Array | QuantizedKernel | None = None
    adapters: Adapters | None = None


def lora_for(weights: Weights, ids: Array) -> lora_math.Lora | None:
    """The adapters of a forward whose rows have adapter ``ids i32[B]`` (None without
    adapters: the base model's forward, unchanged)."""
    a = weights.adapters
    return None if a is None else lora_math.Lora(a.weights, a.scale, ids)


_transposed = jax.jit(jnp.transpose)


def prepare_weights(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    transposed_head: bool,
    weights: Literal["float", "int8"] = "float",
    activations: Activations = "float",
) -> Weights:
    """``params`` for decoding; with ``transposed_head`` a tied head gets a ``[d_model,
    vocab]`` copy, made once (:attr:`jaxlab.runtime.tuning.Tuning.transposed_head`): more
    memory, the same bytes read per step (a lookup touches one table row per token).

    ``weights="int8"`` (``inference.weights``): every dense kernel is quantized
    (:func:`~jaxlab.model.quant.quantize_dense`, per output channel), and so is the LM head:
    an untied one in place, a tied one as an int8 ``[d_model, vocab]`` copy on every
    platform (the table stays float for the lookups). ``activations``: how their matmuls
    treat the input (``inference.activations``)."""
    if weights == "int8":
        params = quantize_dense(params, activations)
        kernel, vocab_major = nnx.merge(graphdef, params).head_kernel()
        head = quantize_tied_head(kernel, activations) if vocab_major else None
        return Weights(params, head)
    kernel, vocab_major = nnx.merge(graphdef, params).head_kernel()
    return Weights(params, _transposed(kernel) if transposed_head and vocab_major else None)


def step_weight_bytes(graphdef: nnx.GraphDef, weights: Weights) -> int:
    """Bytes of weights one decode step reads, whatever the batch: every block's parameters,
    the final norm and the LM head (int8 kernels count their values and scales). The token
    and position tables are left out (a step looks up one row of each per token). At batch
    1 a step can go no faster than one read of these bytes: the ``peer`` benchmark's read
    ceiling divides by it."""
    model = nnx.merge(graphdef, weights.params)
    head = weights.head if weights.head is not None else model.head_kernel()[0]
    return weight_bytes([nnx.state(model.blocks), nnx.state(model.final_norm), head])


def advance_rows(
    tok: Array, active: Array, generated: Array, done: Array, sp: SamplingArrays
) -> tuple[Array, Array]:
    """New ``(generated, done)`` after sampling ``tok`` on the ``active`` rows."""
    generated = jnp.where(active, generated + 1, generated)
    stopped = hits_stop(tok, sp) | (generated >= sp.max_new)
    return generated, done | (active & stopped)


# --------------------------------------------------------------------------- prefill

PrefillFn = Callable[
    [Weights, tuple[PagedCache, ...], Array, Array, Array, Array, Array],
    tuple[tuple[PagedCache, ...], Array],
]
FirstTokenFn = Callable[
    [Weights, Array, Array, Array, Array, Array, Array, SamplingArrays], DecodeState
]


def make_prefill(graphdef: nnx.GraphDef, *, from_start: bool) -> PrefillFn:
    """``prefill(weights, pools, tokens i32[R, T], starts i32[R], lengths i32[R], table
    i32[R, max_pages], adapter i32[R]) -> (pools, last f32[R, d_model])``.

    Row ``r`` holds a chunk's tokens at positions ``starts[r] ..``, right-padded to the
    bucket length ``T``, real up to ``lengths[r]``; ``table[r]`` is its sequence's pages.
    Their K/V are written into the pools through the table (padding tokens land in the
    sequence's own future positions, or nowhere, as in a contiguous cache; a row without
    pages writes nothing). ``from_start`` (every chunk starts at 0): the model's sequence
    forward, attention over the chunk alone, exactly what a whole prompt costs without a
    cache; otherwise :meth:`~jaxlab.model.Transformer.extend` over the pages, which also
    reads the positions before each chunk. Row ``r`` runs with LoRA adapter ``adapter[r]``
    of ``weights.adapters`` (ignored without adapters). ``last`` is each row's final-normed
    hidden state at its last real position: what :func:`make_first_token` samples from.

    The head and sampling are not in this program: they depend on the row count alone,
    and this program is compiled once per (row count, length bucket, from-start or not),
    so as one program they would be compiled again for every length (sampling is about
    half of what XLA:CPU compiles for a prefill).
    """

    def prefill(
        weights: Weights,
        pools: tuple[PagedCache, ...],
        tokens: Array,
        starts: Array,
        lengths: Array,
        table: Array,
        adapter: Array,
    ) -> tuple[tuple[PagedCache, ...], Array]:
        b, t = tokens.shape
        model = nnx.merge(graphdef, weights.params)
        offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        lora = lora_for(weights, adapter)
        if from_start:
            h, cache = model.prefill_pages(tokens, offsets, Pages(pools, table), lora=lora)
        else:
            positions = starts[:, None] + offsets
            h, cache = model.extend(tokens, positions, Pages(pools, table), lora=lora)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return cache.pools, last

    return prefill


def make_first_token(graphdef: nnx.GraphDef, max_len: int) -> FirstTokenFn:
    """``first_token(weights, last f32[R, d_model], starts i32[R], lengths i32[R], table
    i32[R, max_pages], generated i32[R], adapter i32[R], sampling) -> prefix``: the head
    over each row's ``last`` hidden state (:func:`make_prefill`) and the row's next token,
    sampled with key index ``generated[r]``. The prefix is a decode state of ``R`` rows
    with no pools, at position ``starts + lengths``, holding ``table`` and ``adapter``."""

    def first_token(
        weights: Weights,
        last: Array,
        starts: Array,
        lengths: Array,
        table: Array,
        generated: Array,
        adapter: Array,
        sampling: SamplingArrays,
    ) -> DecodeState:
        model = nnx.merge(graphdef, weights.params)
        tok = sample(model.logits(last, weights.head), sampling, generated)
        every = jnp.ones(tok.shape, jnp.bool_)
        generated, done = advance_rows(tok, every, generated, ~every, sampling)
        return DecodeState(
            cache=Pages((), table),
            tokens=tok,
            pos=starts + lengths,
            generated=generated,
            done=done,
            sampling=sampling,
            adapter=adapter,
            max_len=max_len,
        )

    return first_token


# ---------------------------------------------------------------------------- decode


def _advance(
    model: Transformer,
    weights: Weights,
    st: DecodeState,
    cache: C,
    rows: Rows,
) -> tuple[DecodeState, C, Array, Array]:
    """The step both forms share: feed ``st.tokens`` at ``st.pos`` through ``cache`` (the
    caller's view of the pages, with done rows' pages hidden), sample, advance the active
    rows. Returns the state (its cache untouched), the new cache, logits and emitted."""
    active = ~st.done
    pos = jnp.minimum(st.pos, st.max_len - 1)
    h, cache = model.decode(st.tokens, pos, cache, rows=rows, lora=lora_for(weights, st.adapter))

    def head(r: int, h: Array, sp: SamplingArrays, generated: Array) -> tuple[Array, Array]:
        logits = model.logits(h[:r], weights.head)
        return logits, sample(logits, jax.tree.map(lambda a: a[:r], sp), generated[:r])

    logits, tok = rows.run(head, h, st.sampling, st.generated)
    generated, done = advance_rows(tok, active, st.generated, st.done, st.sampling)
    new = dataclasses.replace(
        st,
        tokens=jnp.where(active, tok, st.tokens),
        pos=jnp.where(active, st.pos + 1, st.pos),
        generated=generated,
        done=done,
    )
    return new, cache, logits, jnp.where(active, tok, NO_TOKEN)


def writable(st: DecodeState) -> Pages:
    """The state's pages as a step may write them: done rows get no page (``NO_PAGE``), so
    their writes are dropped; their pages may have gone to another row by now."""
    table = jnp.where(st.done[:, None], st.cache.num_pages, st.cache.table)
    return Pages(st.cache.pools, table)


def decode_step(
    graphdef: nnx.GraphDef, weights: Weights, st: DecodeState, *, buckets: bool
) -> tuple[DecodeState, Array, Array]:
    """One cached step for every row: ``(new state, logits f32[B, V], emitted i32[B])``.

    Feeds ``st.tokens`` at ``st.pos`` (writing its K/V through the row's page table, reading
    the pages through it) and samples the next token with key index ``st.generated``. With
    ``buckets`` (:mod:`jaxlab.kernels.rows`) only the leading rows up to the last active one
    are computed, rounded up to a bucket; rows past them get zero logits. Done rows inside
    that range compute but do not advance, and write nothing (:func:`writable`). Every
    done row's ``emitted`` is :data:`NO_TOKEN`.
    """
    model = nnx.merge(graphdef, weights.params)
    rows = Rows.up_to_last(~st.done, row_buckets(st.slots) if buckets else (st.slots,))
    new, cache, logits, emitted = _advance(model, weights, st, writable(st), rows)
    return dataclasses.replace(new, cache=Pages(cache.pools, st.table)), logits, emitted


@struct.dataclass
class Staging:
    """The carry of a staged decode loop: the rows (their cache holds the table only: the
    loop does not touch the pool) and the staged contiguous cache
    (:mod:`jaxlab.kernels.staged`)."""

    state: DecodeState
    cache: Cache

    @property
    def done(self) -> Array:
        return self.state.done

    def with_done(self, done: Array) -> Staging:
        return Staging(self.state.with_done(done), self.cache)


def staged_step(
    graphdef: nnx.GraphDef, weights: Weights, carry: Staging, *, buckets: bool
) -> tuple[Staging, Array, Array]:
    """:func:`decode_step` against the staged contiguous cache: the contiguous cache's own
    step, row buckets included (a done row writes into its own staged row only, which the
    call never copies back)."""
    model = nnx.merge(graphdef, weights.params)
    st = carry.state
    rows = Rows.up_to_last(~st.done, row_buckets(st.slots) if buckets else (st.slots,))
    new, cache, logits, emitted = _advance(model, weights, st, carry.cache, rows)
    return Staging(new, cache), logits, emitted


def decode_loop(
    step: Callable[[P, S], tuple[S, Array, Array]], params: P, state: S, k: int, unroll: int = 1
) -> tuple[S, Array, Array]:
    """Run ``step`` up to ``k`` times inside ``lax.while_loop``; stop when every row is done.

    ``state`` must have a ``done: bool[B]`` field and, for ``unroll > 1``, a
    ``with_done(done)`` method (:class:`~jaxlab.infer.state.DecodeState`,
    :class:`Staging`). Returns ``(state, tokens i32[k, B], done bool[B])``. ``done`` is a
    separate output buffer (not the state's), so it stays valid after the state is donated
    to the next call: a caller may dispatch chunk ``i + 1`` before reading chunk ``i``'s
    flags.

    ``unroll`` steps run per loop trip
    (:attr:`~jaxlab.runtime.tuning.Tuning.unroll_decode_rows`). A step past ``k`` in the
    last trip runs with every row marked done, so it advances and writes nothing, and emits
    nothing; the rows' own flags are put back after it. The tokens are those of
    ``unroll=1``.
    """
    b = state.done.shape[0]  # type: ignore[attr-defined]
    out = jnp.full((k, b), NO_TOKEN, jnp.int32)

    def cond(carry: tuple[Array, S, Array]) -> Array:
        i, st, _ = carry
        return (i < k) & ~jnp.all(st.done)  # type: ignore[attr-defined]

    def body(carry: tuple[Array, S, Array]) -> tuple[Array, S, Array]:
        i, st, buf = carry
        st, _, emitted = step(params, st)
        buf = jax.lax.dynamic_update_index_in_dim(buf, emitted, i, axis=0)
        for j in range(1, unroll):
            past = i + j >= k  # this trip's step j lies past the loop's k: a no-op
            done = st.done  # type: ignore[attr-defined]
            after, _, emitted = step(params, st.with_done(done | past))  # type: ignore[attr-defined]
            st = after.with_done(jnp.where(past, done, after.done))  # type: ignore[attr-defined]
            at = jnp.minimum(i + j, k - 1)
            kept = jax.lax.dynamic_index_in_dim(buf, at, axis=0, keepdims=False)
            buf = jax.lax.dynamic_update_index_in_dim(
                buf, jnp.where(past, kept, emitted), at, axis=0
            )
        return i + unroll, st, buf

    _, state, out = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, out))
    return state, out, state.done  # type: ignore[attr-defined]


def make_generate(
    graphdef: nnx.GraphDef,
    k: int,
    *,
    buckets: bool,
    staged: bool = False,
    stage_len: int | None = None,
    unroll: int = 1,
) -> Callable[[Weights, DecodeState], tuple[DecodeState, Array, Array]]:
    """``generate(weights, state) -> (state, tokens i32[k, B], done bool[B])``: up to ``k``
    decode steps in one jitted loop. Jit it with the state donated (in-place pools).

    ``staged`` (:attr:`~jaxlab.runtime.tuning.Tuning.staged_pages`): the call stages every
    row's pages into a contiguous cache of ``stage_len`` positions (None: ``max_len``;
    shorter only where the table's pages all lie inside it, ``DecodeState.span``), runs
    the contiguous cache's steps against it (:func:`staged_step`), and writes the
    positions they wrote into the pages after the loop, in one scatter per buffer.
    Otherwise every step reads and writes the pages (:func:`decode_step`). ``unroll``:
    steps per loop trip (:func:`decode_loop`)."""
    if not staged:
        step = functools.partial(decode_step, graphdef, buckets=buckets)

        def generate(weights: Weights, state: DecodeState) -> tuple[DecodeState, Array, Array]:
            return decode_loop(step, weights, state, k, unroll)

        return generate

    stepped = functools.partial(staged_step, graphdef, buckets=buckets)

    def generate_staged(weights: Weights, state: DecodeState) -> tuple[DecodeState, Array, Array]:
        model = nnx.merge(graphdef, weights.params)
        start = jnp.where(state.done, NO_SLOT, state.pos)  # rows that write this call
        cache = model.stage_pages(state.cache, stage_len or state.max_len)
        rows = dataclasses.replace(state, cache=Pages((), state.table))  # the loop's carry
        carry, out, done = decode_loop(stepped, weights, Staging(rows, cache), k, unroll)
        written = model.staged_writes(carry.cache, start, carry.state.pos, k)
        pages = model.write_pages(state.cache, *written)  # the call's only pool write
        return dataclasses.replace(carry.state, cache=pages), out, done

    return generate_staged


# ---------------------------------------------------------------------------- insert


def make_insert() -> Callable[[DecodeState, DecodeState, Array], DecodeState]:
    """``insert(prefix, state, slots i32[R]) -> state``: row ``i`` of the ``R``-row
    ``prefix`` into slot ``slots[i]``, its page-table row included; a negative entry skips
    its row (a padding row, a chunk that is not its prompt's last, or a request that
    finished in prefill). The pools are not touched: prefill already wrote the K/V into
    the pages. A scatter per field with ``mode="drop"``, so no row but the chosen ones
    changes; in place when ``state`` is donated. Slots must be distinct."""

    def insert(prefix: DecodeState, state: DecodeState, slots: Array) -> DecodeState:
        idx = jnp.where(slots >= 0, slots, state.slots)  # out of range -> dropped

        def put(big: Array, rows: Array) -> Array:
            return big.at[idx].set(rows.astype(big.dtype), mode="drop")

        fields = jax.tree.map(
            put, dataclasses.replace(state, cache=()), dataclasses.replace(prefix, cache=())
        )
        table = put(state.cache.table, prefix.cache.table)
        return dataclasses.replace(fields, cache=Pages(state.cache.pools, table))

    return insert


__all__ = [
    "NO_TOKEN",
    "Adapters",
    "FirstTokenFn",
    "PrefillFn",
    "Staging",
    "Weights",
    "advance_rows",
    "decode_loop",
    "decode_step",
    "lora_for",
    "make_first_token",
    "make_generate",
    "make_insert",
    "make_prefill",
    "prepare_weights",
    "staged_step",
    "step_weight_bytes",
    "writable",
]
