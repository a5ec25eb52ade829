"""The cache-free baseline: every step recomputes the whole prefix, behind the engine's verbs.

:class:`NaiveEngine` answers ``prefill`` and ``generate`` like
:class:`~jaxlab.infer.engine.Engine`, so offline generation runs it unchanged
(``kv_cache=False``). Each step runs the model's sequence forward over the whole padded
``[B, max_len]`` buffer and reads the logits at each row's last real position. It exists
to measure what the KV cache saves, and as a second, independent path that cached decoding
must agree with.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxlab.infer.engine import Engine, Prefill, put
from jaxlab.infer.sampling import SamplingArrays, SamplingParams, sample, sampling_arrays
from jaxlab.infer.steps import NO_TOKEN, advance_rows, decode_loop
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
    graphdef: nnx.GraphDef, params: nnx.State, st: NaiveState
) -> tuple[NaiveState, Array, Array]:
    """One cache-free step: the whole ``[B, max_len]`` buffer, logits read at ``pos``.

    The causal mask hides everything after ``pos`` (right padding, stale tokens), so the
    logits at ``pos`` are those of the prefix ``buf[:pos + 1]``.
    """
    b, s = st.buf.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    model = nnx.merge(graphdef, params)
    h = model.features(st.buf, positions)
    logits = model.logits(jnp.take_along_axis(h, st.pos[:, None, None], axis=1)[:, 0])
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
    """``prefill`` / ``generate`` without a KV cache, over ``engine``'s model and params.

    Its compiles are counted with ``engine``'s (``naive_prefill``, ``naive_generate``).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_len = engine.max_len
        graphdef = engine.graphdef

        def first(params: nnx.State, state: NaiveState) -> tuple[NaiveState, Array, Array]:
            new, _, emitted = naive_step(graphdef, params, state)
            return new, emitted, new.done

        self._prefill = engine.track(
            ShapeKeyedJit(first, name="naive_prefill", donate_argnums=(1,))
        )
        self._generate: dict[int, ShapeKeyedJit] = {}

    def initial_state(
        self, prompts: Sequence[Sequence[int]], samplings: Sequence[SamplingParams]
    ) -> NaiveState:
        """The prompts in one ``[B, max_len]`` buffer, before any step."""
        b = len(prompts)
        buf = np.zeros((b, self.max_len), np.int32)
        for i, p in enumerate(prompts):
            buf[i, : len(p)] = p
        return NaiveState(
            buf=put(buf),
            pos=put(np.array([len(p) - 1 for p in prompts], np.int32)),
            generated=put(np.zeros((b,), np.int32)),
            done=put(np.zeros((b,), np.bool_)),
            sampling=sampling_arrays(samplings),
        )

    def prefill(
        self, prompts: Sequence[Sequence[int]], samplings: Sequence[SamplingParams]
    ) -> Prefill:
        """The first step over the whole prompts: their first tokens."""
        state, tokens, done = self._prefill(
            self.engine.params, self.initial_state(prompts, samplings)
        )
        return Prefill(state, tokens, done, None)

    def generate(self, state: NaiveState, k: int | None = None) -> tuple[NaiveState, Array, Array]:
        """Up to ``k`` cache-free steps in one jitted loop (``state`` donated)."""
        k = k or self.engine.cfg.inference.stream_chunk_tokens
        fn = self._generate.get(k)
        if fn is None:
            step = functools.partial(naive_step, self.engine.graphdef)

            def loop(params: nnx.State, st: NaiveState) -> tuple[NaiveState, Array, Array]:
                return decode_loop(step, params, st, k)

            fn = self.engine.track(ShapeKeyedJit(loop, name="naive_generate", donate_argnums=(1,)))
            self._generate[k] = fn
        return fn(self.engine.params, state)


__all__ = ["NaiveEngine", "NaiveState", "naive_step"]
