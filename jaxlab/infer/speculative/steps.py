"""The pure functions speculative decoding jits: the decode loop with its proposals and verify
passes, the prefill's extra writes (token ids, the draft model's K/V), insert, a zero state.

Like :mod:`jaxlab.infer.steps`, each ``make_*`` closes over the static pieces (graphdefs,
:class:`SpecParams`, the loop's token budget ``n``) and returns a function of array pytrees
for :class:`~jaxlab.runtime.compiled.ShapeKeyedJit`; nothing here touches the host.

One step of the loop, for every row at once (``docs/speculative.md``)::

    propose: prompt lookup over the row's tokens (or: the draft model will draft)
    if some row has drafts:  verify  (the draft model's k steps; one forward over
                                      [token, d_1 .. d_k] at pos .. pos + k; accept;
                                      roll the rejected positions back)
    else:                    plain   (the engine's one-token step)
    emit the kept tokens (at most the row's budget and the call's room; a stop token ends it)

Plain steps and verify steps run in two inner loops that take turns (a ``lax.cond``
between them would copy the KV cache every step on XLA:CPU). A row emits up to ``k + 1``
tokens a step and at most ``n`` a call, so every position a
call writes lies below the row's position at the call's start plus ``n``: the pages a plain
call of ``n`` steps needs cover a speculative call too. Rolled back means: the K/V of
rejected drafts never reach the pool. Staged (XLA:CPU), the pool only receives the
positions a row kept, after the loop; reading pages every step (accelerators), the pool
positions a verify overwrote beyond what the row kept get their old contents back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxlab.infer.sampling import SamplingArrays, argmax, filtered, inverse_cdf, sample
from jaxlab.infer.speculative.accept import DRAFT_STREAM, accept, index_keys, stream_uniforms
from jaxlab.infer.speculative.ngram import lookup
from jaxlab.infer.speculative.state import SpecState, SpecStats
from jaxlab.infer.state import DecodeState
from jaxlab.infer.steps import NO_TOKEN, Weights, make_insert
from jaxlab.kernels import NO_SLOT
from jaxlab.kernels.paged import PagedCache, Pages, token_slots
from jaxlab.kernels.rows import Rows, row_buckets
from jaxlab.model.transformer import Transformer

Array = jax.Array


@dataclass(frozen=True)
class SpecParams:
    """The static half of :class:`~jaxlab.config.SpeculativeConfig` (hashable)."""

    k: int
    method: str  # "ngram" or "draft"
    ngram_min: int = 2
    ngram_max: int = 4
    min_acceptance: float = 0.3
    probe_tokens: int = 36


# --------------------------------------------------------------------------- token pages


def gather_history(pool: Array, table: Array) -> Array:
    """``i32[B, max_pages * page_size]``: each row's token ids, position ``p`` at ``p``
    (positions without a page read some page: never looked at)."""
    b = table.shape[0]
    return pool[jnp.clip(table, 0, pool.shape[0] - 1)].reshape(b, -1)


def write_tokens(pool: Array, table: Array, positions: Array, tokens: Array) -> Array:
    """``pool`` with ``tokens [B, T]`` at ``positions [B, T]`` through the table (``>= NO_SLOT``
    or without a page: dropped)."""
    num_pages, ps = pool.shape
    slots = token_slots(table, positions, num_pages, ps).reshape(-1)
    flat = pool.reshape(-1).at[slots].set(tokens.reshape(-1), mode="drop", unique_indices=True)
    return flat.reshape(pool.shape)


def call_positions(start: Array, end: Array, n: int) -> Array:
    """``i32[B, n]``: positions ``start[b] .. end[b] - 1`` (a call's kept ones), the rest
    ``NO_SLOT``; ``start >= NO_SLOT`` marks a row the call did not run."""
    positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    kept = (start[:, None] < NO_SLOT) & (positions < end[:, None])
    return jnp.where(kept, positions, NO_SLOT)


# --------------------------------------------------------------------------- the loop


@struct.dataclass
class Carry:
    """The loop's carry: the rows (their cache holds the table only), the target's and the
    draft's caches (staged contiguous ones, or the pages), each row's token ids as a
    contiguous ``[B, S]`` copy, the counters, the call's output, and the next step's
    proposals."""

    rows: DecodeState
    cache: Any
    draft: Any
    history: Array  # i32[B, S]
    drafted: Array
    accepted: Array
    on: Array
    count: Array  # i32[B]: tokens emitted this call
    out: Array  # i32[n, B]
    drafts: Array  # i32[B, k]: the next step's drafts (prompt lookup)
    wants: Array  # bool[B]: the row verifies drafts in the next step


@struct.dataclass
class Step:
    """What a step's branch (verify or plain) hands back: the row's candidate tokens (kept
    drafts, then the token drawn where it stopped), the tokens it fed from its position on,
    accepted drafts, tokens emitted, and the new caches."""

    tokens: Array  # i32[B, k + 1]
    fed: Array  # i32[B, k + 1]
    accepted: Array  # i32[B]
    emitted: Array  # i32[B]
    cache: Any
    draft: Any


def emission(
    tokens: Array, accepted: Array, active: Array, room: Array, sp: SamplingArrays
) -> Array:
    """``i32[B]``: tokens each active row emits: its kept drafts and the drawn token, at most
    ``room`` (its budget, and the call's), cut after the first stop token."""
    t = tokens.shape[1]
    i = jnp.arange(t)[None, :]
    m = jnp.minimum(accepted + 1, room)
    stop = jnp.any(tokens[:, :, None] == sp.stop[:, None, :], axis=-1) & (i < m[:, None])
    first = jnp.min(jnp.where(stop, i, t), axis=1)
    return jnp.where(active, jnp.minimum(m, first + 1), 0).astype(jnp.int32)


def hidden_rows(cache: Any, frozen: Array) -> Any:
    """A paged cache as a step may write it: frozen rows (done, or out of room this call)
    get no page, so their writes are dropped. A staged contiguous cache is the call's own:
    returned as it is."""
    if isinstance(cache, Pages):
        return Pages(cache.pools, jnp.where(frozen[:, None], cache.num_pages, cache.table))
    return cache


def with_table(cache: Any, table: Array) -> Any:
    return Pages(cache.pools, table) if isinstance(cache, Pages) else cache


def read_pages(model: Transformer, pages: Pages, positions: Array) -> tuple[list[Array], ...]:
    """Every layer's ``(k, v) [B, T, K, D]`` at ``positions`` through the table."""
    ks, vs = [], []
    for i, block in enumerate(model.blocks):
        k, v = block.attn.paged_kernel.read_at(pages.layer(i), positions)
        ks.append(k)
        vs.append(v)
    return ks, vs


def draft_tokens(
    dmodel: Transformer,
    dweights: Weights,
    cache: Any,
    history: Array,
    st: DecodeState,
    rows: Rows,
    k: int,
) -> tuple[Array, Array, Any]:
    """``k`` drafts per row from the draft model: ``(drafts i32[B, k], q f32[B, k, V],
    cache)``. The first step feeds the tokens at ``pos - 1`` and ``pos`` (the one before may
    be missing: the last verify's final draft is never fed to the draft model), the others
    one draft each. Draws use the row's sampling parameters and ``fold_in(key_t,
    DRAFT_STREAM)``; greedy rows take the argmax (their ``q`` is not read)."""
    first = jnp.maximum(st.pos - 1, 0)
    prev = jnp.take_along_axis(history, first[:, None], axis=1)[:, 0]
    fed = jnp.stack([prev, st.tokens], axis=1)
    h, cache = dmodel.extend(fed, first[:, None] + jnp.arange(2)[None, :], cache, rows=rows)
    h = h[:, 1]

    def draw(r: int, h: Array, sp: SamplingArrays, t: Array) -> tuple[Array, Array]:
        sp = jax.tree.map(lambda a: a[:r], sp)
        logits = dmodel.logits(h[:r], dweights.head).astype(jnp.float32)
        greedy = argmax(logits)

        def sampled() -> tuple[Array, Array]:
            masked = filtered(logits, sp)
            u = stream_uniforms(index_keys(sp.seed, t[:r], 1)[:, 0], DRAFT_STREAM)
            d = jnp.where(sp.temperature > 0, inverse_cdf(masked, u), greedy)
            return d, jax.nn.softmax(masked, axis=-1)

        return jax.lax.cond(
            jnp.all(sp.temperature <= 0), lambda: (greedy, jnp.zeros_like(logits)), sampled
        )

    drafts, probs = [], []
    for i in range(k):
        if i:
            h, cache = dmodel.decode(drafts[-1], st.pos + i, cache, rows=rows)
        d, q = rows.run(draw, h, st.sampling, st.generated + i)
        drafts.append(d)
        probs.append(q)
    return jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1), cache


def make_spec_generate(
    graphdef: nnx.GraphDef,
    draft_graphdef: nnx.GraphDef | None,
    spec: SpecParams,
    n: int,
    *,
    buckets: bool,
    staged: bool,
) -> Callable[[Weights, Weights | None, SpecState], tuple[SpecState, Array, Array, SpecStats]]:
    """``generate(weights, draft_weights, state) -> (state, tokens i32[n, B], done bool[B],
    stats)``: speculative decode steps in one jitted loop until every row is done or has
    emitted ``n`` tokens this call (module docstring). ``tokens[i, b]`` is row ``b``'s
    ``i``-th token of the call or ``NO_TOKEN``. Jit with the state donated.

    The loop alternates two inner loops, plain steps while no row has drafts and verify
    steps while some row has, instead of a ``lax.cond`` between the two kinds of step:
    XLA:CPU copies every buffer a conditional's branch updates in place (the whole KV
    cache, each step), while loops update their carry in place.

    ``staged`` (:attr:`~jaxlab.runtime.tuning.Tuning.staged_pages`): the call stages the
    rows' pages (the target's and the draft's) into contiguous caches, and writes back only
    the positions each row kept; otherwise every step reads and writes the pages, and a
    verify restores the positions it rejected.
    """
    k = spec.k

    def generate(
        weights: Weights, draft_weights: Weights | None, state: SpecState
    ) -> tuple[SpecState, Array, Array, SpecStats]:
        model = nnx.merge(graphdef, weights.params)
        dmodel = None
        if draft_graphdef is not None:
            assert draft_weights is not None
            dmodel = nnx.merge(draft_graphdef, draft_weights.params)
        st = state.target
        table, max_len, b = st.table, st.max_len, st.slots
        sizes = row_buckets(b) if buckets else (b,)
        start = jnp.where(st.done, NO_SLOT, st.pos)  # rows that may write this call
        draft_pages = Pages(state.draft, table)
        if staged:
            cache: Any = model.stage_pages(st.cache, max_len)
            dcache: Any = () if dmodel is None else dmodel.stage_pages(draft_pages, max_len)
        else:
            cache, dcache = st.cache, (() if dmodel is None else draft_pages)
        history = gather_history(state.history, table)
        s_hist = history.shape[1]

        def frozen(c: Carry) -> Array:
            """Rows that do not step: done, or out of room in this call."""
            return c.rows.done | (c.count >= n)

        def room(c: Carry) -> Array:
            return jnp.minimum(c.rows.sampling.max_new - c.rows.generated, n - c.count)

        def proposed(c: Carry) -> Carry:
            """The next step's drafts (prompt lookup) and which rows will verify them."""
            st = c.rows
            wants = ~frozen(c) & c.on & (room(c) >= 2)
            if dmodel is None:
                drafts, found = lookup(
                    c.history, st.tokens, st.pos, k, spec.ngram_min, spec.ngram_max
                )
                return dataclasses.replace(c, drafts=drafts, wants=wants & found)
            return dataclasses.replace(c, wants=wants)  # the draft model drafts in the step

        def views(c: Carry) -> tuple[Any, Any, Rows]:
            hidden = frozen(c)
            rows = Rows.up_to_last(~hidden, sizes)
            tview = hidden_rows(with_table(c.cache, table), hidden)
            dview = hidden_rows(with_table(c.draft, table), hidden)
            return tview, dview, rows

        def plain(c: Carry) -> Carry:
            st, sp = c.rows, c.rows.sampling
            tview, dview, rows = views(c)
            pos = jnp.minimum(st.pos, max_len - 1)
            h, new = model.decode(st.tokens, pos, tview, rows=rows)

            def head(r: int, h: Array, sp: SamplingArrays, t: Array) -> tuple[Array]:
                logits = model.logits(h[:r], weights.head)
                return (sample(logits, jax.tree.map(lambda a: a[:r], sp), t[:r]),)

            (tok,) = rows.run(head, h, sp, st.generated)
            tokens = jnp.broadcast_to(tok[:, None], (b, k + 1))
            fed = jnp.concatenate([st.tokens[:, None], jnp.zeros((b, k), jnp.int32)], axis=1)
            nacc = jnp.zeros((b,), jnp.int32)
            emitted = emission(tokens, nacc, ~frozen(c), room(c), sp)
            return advance(c, Step(tokens, fed, nacc, emitted, new, dview))

        def verify(c: Carry) -> Carry:
            st, sp = c.rows, c.rows.sampling
            tview, dview, rows = views(c)
            active = ~frozen(c)
            if dmodel is None:
                drafts, probs, dnew = c.drafts, None, dview
            else:
                assert draft_weights is not None
                drafts, probs, dnew = draft_tokens(
                    dmodel, draft_weights, dview, c.history, st, rows, k
                )
            fed = jnp.concatenate([st.tokens[:, None], drafts], axis=1)
            positions = st.pos[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
            saved = None if staged else read_pages(model, tview, positions[:, 1:])
            h, new = model.extend(fed, positions, tview, rows=rows)

            def head(
                r: int,
                h: Array,
                drafts: Array,
                wants: Array,
                sp: SamplingArrays,
                t: Array,
                *probs: Array,
            ) -> tuple[Array, Array]:
                sp_r = jax.tree.map(lambda a: a[:r], sp)
                logits = model.logits(h[:r], weights.head)
                q = probs[0][:r] if probs else None
                return accept(logits, drafts[:r], q, wants[:r], sp_r, t[:r])

            extra = () if probs is None else (probs,)
            tokens, nacc = rows.run(head, h, drafts, c.wants, sp, st.generated, *extra)
            emitted = emission(tokens, nacc, active, room(c), sp)
            if saved is not None:  # roll back what the verify wrote past the kept tokens
                i = jnp.arange(1, k + 1)[None, :]
                back = jnp.where(
                    active[:, None] & (i >= emitted[:, None]), positions[:, 1:], NO_SLOT
                )
                new = model.write_pages(new, tuple(saved[0]), tuple(saved[1]), back)
            return advance(c, Step(tokens, fed, nacc, emitted, new, dnew))

        def advance(c: Carry, out: Step) -> Carry:
            """The rows after a step: emitted tokens out, state, token history, counters."""
            st, sp = c.rows, c.rows.sampling
            active = ~frozen(c)
            e = out.emitted
            i = jnp.arange(k + 1)[None, :]
            keep = i < e[:, None]
            last = jnp.take_along_axis(out.tokens, jnp.maximum(e - 1, 0)[:, None], axis=1)[:, 0]
            generated = st.generated + e
            stop = jnp.any(out.tokens[:, :, None] == sp.stop[:, None, :], axis=-1)
            hit = jnp.any(stop & keep, axis=1)
            rows_next = dataclasses.replace(
                st,
                tokens=jnp.where(active, last, st.tokens),
                pos=st.pos + e,
                generated=generated,
                done=st.done | (active & (hit | (generated >= sp.max_new))),
            )
            batch = jnp.arange(b)[:, None]
            hist = c.history.at[batch, jnp.where(keep, st.pos[:, None] + i, s_hist)].set(
                out.fed, mode="drop"
            )
            buf = c.out.at[jnp.where(keep, c.count[:, None] + i, n), batch].set(
                out.tokens, mode="drop"
            )
            drafted = c.drafted + jnp.where(c.wants, k, 0)
            accepted = c.accepted + jnp.where(c.wants, out.accepted, 0)
            low = accepted.astype(jnp.float32) < spec.min_acceptance * drafted
            on = c.on & ~((drafted >= spec.probe_tokens) & low)
            nxt = dataclasses.replace(
                c,
                rows=rows_next,
                cache=with_table(out.cache, table),
                draft=with_table(out.draft, table),
                history=hist,
                drafted=drafted,
                accepted=accepted,
                on=on,
                count=c.count + e,
                out=buf,
            )
            return proposed(nxt)

        def more(c: Carry) -> Array:
            return jnp.any(~frozen(c))

        def plain_steps(c: Carry) -> Carry:
            return jax.lax.while_loop(lambda c: more(c) & ~jnp.any(c.wants), plain, c)

        def verify_steps(c: Carry) -> Carry:
            return jax.lax.while_loop(lambda c: more(c) & jnp.any(c.wants), verify, c)

        rows0 = dataclasses.replace(st, cache=Pages((), table))
        carry = Carry(
            rows=rows0,
            cache=cache,
            draft=dcache,
            history=history,
            drafted=state.drafted,
            accepted=state.accepted,
            on=state.on,
            count=jnp.zeros((b,), jnp.int32),
            out=jnp.full((n, b), NO_TOKEN, jnp.int32),
            drafts=jnp.zeros((b, k), jnp.int32),
            wants=jnp.zeros((b,), jnp.bool_),
        )
        carry = jax.lax.while_loop(more, lambda c: verify_steps(plain_steps(c)), proposed(carry))
        end = carry.rows.pos
        if staged:
            pages = model.write_pages(st.cache, *model.staged_writes(carry.cache, start, end, n))
            dpools = state.draft
            if dmodel is not None:
                written = dmodel.staged_writes(carry.draft, start, end, n)
                dpools = dmodel.write_pages(draft_pages, *written).pools
        else:
            pages = Pages(carry.cache.pools, table)
            dpools = () if dmodel is None else carry.draft.pools
        kept = call_positions(start, end, n)
        values = jnp.take_along_axis(carry.history, jnp.clip(kept, 0, s_hist - 1), axis=1)
        new = SpecState(
            target=dataclasses.replace(carry.rows, cache=pages),
            history=write_tokens(state.history, table, kept, values),
            draft=dpools,
            drafted=carry.drafted,
            accepted=carry.accepted,
            on=carry.on,
        )
        stats = SpecStats(carry.drafted - state.drafted, carry.accepted - state.accepted, carry.on)
        return new, carry.out, carry.rows.done, stats

    return generate


# --------------------------------------------------------------------------- prefill, insert


def make_spec_prefill(
    draft_graphdef: nnx.GraphDef | None, *, from_start: bool
) -> Callable[..., tuple[Array, tuple[PagedCache, ...]]]:
    """``prefill(draft_weights, draft_pools, history, tokens, starts, lengths, table) ->
    (history, draft_pools)``: what a prefill writes besides the target's K/V (its arrays
    are the target prefill's, :func:`~jaxlab.infer.chunks.batch_chunks`): each chunk's
    token ids into the token pool, and with a draft model its K/V into the draft pools
    (the sequence forward from position 0, or an extend over the pages)."""

    def prefill(
        draft_weights: Weights | None,
        draft_pools: tuple[PagedCache, ...],
        history: Array,
        tokens: Array,
        starts: Array,
        lengths: Array,
        table: Array,
    ) -> tuple[Array, tuple[PagedCache, ...]]:
        b, t = tokens.shape
        offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = starts[:, None] + offsets
        real = offsets < lengths[:, None]
        history = write_tokens(history, table, jnp.where(real, positions, NO_SLOT), tokens)
        if draft_graphdef is None:
            return history, draft_pools
        assert draft_weights is not None
        dmodel = nnx.merge(draft_graphdef, draft_weights.params)
        pages = Pages(draft_pools, table)
        if from_start:
            _, pages = dmodel.prefill_pages(tokens, offsets, pages)
        else:
            _, pages = dmodel.extend(tokens, positions, pages)
        return history, pages.pools

    return prefill


def make_spec_insert() -> Callable[[DecodeState, SpecState, Array], SpecState]:
    """``insert(prefix, state, slots)``: the engine's insert of the target's rows, and each
    chosen slot's counters reset (it speculates again, from zero)."""
    base = make_insert()

    def insert(prefix: DecodeState, state: SpecState, slots: Array) -> SpecState:
        idx = jnp.where(slots >= 0, slots, state.slots)
        return SpecState(
            target=base(prefix, state.target, slots),
            history=state.history,
            draft=state.draft,
            drafted=state.drafted.at[idx].set(0, mode="drop"),
            accepted=state.accepted.at[idx].set(0, mode="drop"),
            on=state.on.at[idx].set(True, mode="drop"),
        )

    return insert


__all__ = [
    "Carry",
    "SpecParams",
    "Step",
    "call_positions",
    "draft_tokens",
    "emission",
    "gather_history",
    "make_spec_generate",
    "make_spec_insert",
    "make_spec_prefill",
    "write_tokens",
]
