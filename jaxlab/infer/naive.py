"""The cache-free baseline: every step recomputes the whole prefix, behind the engine's verbs.

:class:`NaiveEngine` answers the verbs of :class:`~jaxlab.infer.engine.Engine`
(``init_decode_state``, ``set_table``, ``prefill``, ``insert``, ``generate``), so offline
generation runs it unchanged (``kv_cache=False``). Each step runs the model's sequence
forward over the whole padded ``[B, max_len]`` buffer and reads the logits at each row's
last real position. It exists to measure what the KV cache saves, and as a second,
independent path that cached decoding must agree with. Having no cache, it has no pages:
``set_table`` changes nothing, and its chunks must be whole prompts (start 0, last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlab.infer.chunks import Chunk
from jaxlab.infer.engine import Engine, Prefill, put
from jaxlab.infer.sampling import (
    SamplingArrays,
    SamplingParams,
    empty_sampling_arrays,
    sample,
    sampling_arrays,
)
from jaxlab.infer.steps import NO_TOKEN, Weights, advance_rows, decode_loop
from jaxlab.runtime.compiled import ShapeKeyedJit

Array = jax.Array


@struct.dataclass
class NaiveState:
    """``buf[b, :pos[b] + 1]`` holds the prompt and the tokens generated so far; the logits
    at index ``pos[b]`` predict the next token. ``generated``/``done``/``sampling`` are as
    in :class:`~jaxlab.infer.state.DecodeState`."""

    buf: Array  # i32[B, max_len]
    pos: Array  # i32[B], index of the last real token
    generated: Array  # i32[B]
    done: Array  # bool[B]
    sampling: SamplingArrays


def naive_step(
    graphdef: nnx.GraphDef, params: nnx.State, st: NaiveState, head: Any = None
) -> tuple[NaiveState, Array, Array]:
    """One cache-free step: the whole ``[B, max_len]`` buffer, logits read at ``pos``.

    The causal mask hides everything after ``pos`` (right padding, stale tokens), so the
    logits at ``pos`` are those of the prefix ``buf[:pos + 1]``. ``head``: the LM head the
    engine decodes with (:class:`~jaxlab.infer.steps.Weights`), None for the model's own.
    """
    b, s = st.buf.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    model = nnx.merge(graphdef, params)
    h = model.features(st.buf, positions)
    logits = model.logits(jnp.take_along_axis(h, st.pos[:, None, None], axis=1)[:, 0], head)
    tok = sample(logits, st.sampling, st.generated)
    active = ~st.done
    generated, done = advance_rows(tok, active, st.generated, st.done, st.sampling)
    nxt = jnp.minimum(st.pos + 1, s - 1)
    cur = jnp.take_along_axis(st.buf, nxt[:, None], axis=1)[:, 0]
    buf = st.buf.at[jnp.arange(b), nxt].set(jnp.where(active, tok, cur))
    new = NaiveState(
        buf=buf,
        pos=jnp.where(active, nxt, st.pos),
        generated=generated,
        done=done,
        sampling=st.sampling,
    )
    return new, logits, jnp.where(active, tok, NO_TOKEN)


class NaiveEngine:
    """The engine's verbs without a KV cache, over ``engine``'s model and params.

    Its compiles are counted with ``engine``'s (``naive_prefill``, ``naive_insert``,
    ``naive_generate``).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_len = engine.max_len
        graphdef = engine.graphdef

        def first(weights: Weights, state: NaiveState) -> tuple[NaiveState, Array, Array]:
            new, _, emitted = naive_step(graphdef, weights.params, state, weights.head)
            return new, emitted, new.done

        def insert(prefix: NaiveState, state: NaiveState, slots: Array) -> NaiveState:
            idx = jnp.where(slots >= 0, slots, state.done.shape[0])  # out of range: dropped
            return jax.tree.map(
                lambda big, rows: big.at[idx].set(rows.astype(big.dtype), mode="drop"),
                state,
                prefix,
            )

        self._prefill = engine.track(
            ShapeKeyedJit(first, name="naive_prefill", donate_argnums=(1,))
        )
        self._insert = engine.track(ShapeKeyedJit(insert, name="naive_insert", donate_argnums=(1,)))
        self._generate: dict[int, ShapeKeyedJit] = {}

    def initial_state(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        generated: Sequence[int] | None = None,
    ) -> NaiveState:
        """The prompts in one ``[B, max_len]`` buffer, before any step; ``generated``: each
        row's sampled tokens so far (the index of its next sampling key)."""
        b = len(prompts)
        buf = np.zeros((b, self.max_len), np.int32)
        for i, p in enumerate(prompts):
            buf[i, : len(p)] = p
        return NaiveState(
            buf=put(buf),
            pos=put(np.array([len(p) - 1 for p in prompts], np.int32)),
            generated=put(np.asarray(generated or [0] * b, np.int32)),
            done=put(np.zeros((b,), np.bool_)),
            sampling=sampling_arrays(samplings),
        )

    def init_decode_state(self, slots: int, num_pages: int | None = None) -> NaiveState:
        """``slots`` empty (done) rows; ``num_pages`` is ignored (no cache, no pages)."""
        return NaiveState(
            buf=put(np.zeros((slots, self.max_len), np.int32)),
            pos=put(np.zeros((slots,), np.int32)),
            generated=put(np.zeros((slots,), np.int32)),
            done=put(np.ones((slots,), np.bool_)),
            sampling=empty_sampling_arrays(slots),
        )

    def set_table(self, state: NaiveState, table: np.ndarray) -> NaiveState:
        """No pages to follow: ``state`` unchanged."""
        return state

    def prefill(
        self,
        state: NaiveState,
        chunks: Sequence[Chunk],
        *,
        bucket: int | None = None,
        params: nnx.State | None = None,
    ) -> tuple[NaiveState, Prefill]:
        """The first step over whole prompts (chunks from 0 that are their prompt's last):
        their first tokens. ``state`` is returned unchanged (nothing to write)."""
        if any(c.start != 0 or not c.last for c in chunks):
            raise ValueError("the cache-free baseline prefills whole prompts only")
        prefix = self.initial_state(
            [c.tokens for c in chunks], [c.sampling for c in chunks], [c.generated for c in chunks]
        )
        prefix, tokens, done = self._prefill(self.engine.weights(), prefix)
        return state, Prefill(prefix, tokens, done, None, tuple(True for _ in chunks))

    def insert(self, prefix: Prefill, state: NaiveState, slots: Sequence[int]) -> NaiveState:
        """Row ``i`` of the prefix into slot ``slots[i]`` (``-1`` skips it); ``state`` donated."""
        if len(slots) != len(prefix.last):
            raise ValueError(f"{len(slots)} slots for a prefill of {len(prefix.last)} chunks")
        return self._insert(prefix.state, state, put(np.asarray(slots, np.int32)))

    def generate(self, state: NaiveState, k: int | None = None) -> tuple[NaiveState, Array, Array]:
        """Up to ``k`` cache-free steps in one jitted loop (``state`` donated)."""
        k = k or self.engine.cfg.inference.stream_chunk_tokens
        fn = self._generate.get(k)
        if fn is None:
            graphdef = self.engine.graphdef

            def step(weights: Weights, st: NaiveState) -> tuple[NaiveState, Array, Array]:
                return naive_step(graphdef, weights.params, st, weights.head)

            def loop(weights: Weights, st: NaiveState) -> tuple[NaiveState, Array, Array]:
                return decode_loop(step, weights, st, k)

            fn = self.engine.track(ShapeKeyedJit(loop, name="naive_generate", donate_argnums=(1,)))
            self._generate[k] = fn
        return fn(self.engine.weights(), state)


__all__ = ["NaiveEngine", "NaiveState", "naive_step"]
