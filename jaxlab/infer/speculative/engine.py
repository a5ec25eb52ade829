"""``SpeculativeEngine``: the engine's verbs, with decode calls that speculate.

It wraps an :class:`~jaxlab.infer.engine.Engine` (the target) and, for the ``draft``
method, a second one (the draft model, :func:`~jaxlab.infer.speculative.load_draft`), and
answers the same verbs over a :class:`~jaxlab.infer.speculative.state.SpecState`, so
offline generation and the server's scheduler run it unchanged::

    spec = SpeculativeEngine(engine, cfg.inference.speculative)        # prompt lookup
    state = spec.init_decode_state(slots, num_pages)
    state, pre = spec.prefill(state, chunks)     # the target's prefill, token ids, draft K/V
    state = spec.insert(pre, state, slots)
    state, tokens, done, stats = spec.generate(state, n)   # <= n tokens per row

``generate`` returns one more output than the engine's, ``stats``
(:class:`~jaxlab.infer.speculative.state.SpecStats`: per row, the tokens drafted and
accepted in the call, and whether the row still speculates). Its compiles are counted with
the target engine's (``spec_generate`` once per (n, slots) for a given pool, ``spec_prefill``
per prefill shape, ``spec_insert``, ``spec_init``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlab.config.schema import JaxlabConfig, SpeculativeConfig
from jaxlab.infer.chunks import Chunk, batch_chunks
from jaxlab.infer.engine import Engine, Prefill, put
from jaxlab.infer.request import Limits
from jaxlab.infer.speculative.state import SpecState, SpecStats
from jaxlab.infer.speculative.steps import (
    SpecParams,
    make_spec_generate,
    make_spec_insert,
    make_spec_prefill,
)
from jaxlab.kernels.paged import PagedCache
from jaxlab.runtime.compiled import CompileTiming, ShapeKeyedJit

if TYPE_CHECKING:
    from jaxlab.infer.naive import NaiveEngine
    from jaxlab.tokenizer import Tokenizer

Array = jax.Array


def spec_params(cfg: SpeculativeConfig) -> SpecParams:
    return SpecParams(
        k=cfg.k,
        method=cfg.method,
        ngram_min=cfg.ngram_min,
        ngram_max=cfg.ngram_max,
        min_acceptance=cfg.min_acceptance,
        probe_tokens=cfg.probe_tokens,
    )


class SpeculativeEngine:
    """The target engine's verbs, speculating (module docstring).

    Args:
      engine: the target model's engine (its weights, pool sizing and prefill are used).
      spec: ``inference.speculative`` (``method`` ``"ngram"`` or ``"draft"``).
      draft: the draft model's engine (method ``"draft"``), with the target's vocabulary,
        ``max_len`` and page size.
    """

    def __init__(
        self, engine: Engine, spec: SpeculativeConfig, draft: Engine | None = None
    ) -> None:
        if spec.method not in ("ngram", "draft"):
            raise ValueError(f"inference.speculative.method = {spec.method!r}: nothing to run")
        if (spec.method == "draft") != (draft is not None):
            raise ValueError("a draft engine is needed for method 'draft', and only for it")
        if engine.num_adapters:
            # Its steps run the model without the rows' adapters: it would serve base output.
            raise ValueError(
                f"inference.speculative.method = {spec.method!r} cannot serve LoRA adapters "
                f"({engine.num_adapters} loaded); set inference.speculative.method=off or "
                "serve without adapters"
            )
        if draft is not None:
            for name in ("vocab_size", "max_len", "page_size"):
                if getattr(draft, name) != getattr(engine, name):
                    raise ValueError(
                        f"the draft engine's {name} ({getattr(draft, name)}) differs from the"
                        f" target's ({getattr(engine, name)})"
                    )
        self.target = engine
        self.draft = draft
        self.spec = spec
        self.spec_params = spec_params(spec)
        dgraph = None if draft is None else draft.graphdef
        self._prefill = {
            from_start: engine.track(
                ShapeKeyedJit(
                    make_spec_prefill(dgraph, from_start=from_start),
                    name="spec_prefill",
                    donate_argnums=(1, 2),
                    warn_on_recompile=False,
                )
            )
            for from_start in (True, False)
        }
        self._insert = engine.track(
            ShapeKeyedJit(
                make_spec_insert(), name="spec_insert", donate_argnums=(1,), warn_on_recompile=False
            )
        )
        self._generate: dict[int, ShapeKeyedJit] = {}
        self._zeros: dict[int, ShapeKeyedJit] = {}

    # ------------------------------------------------------------------ the target's facts

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def k(self) -> int:
        return self.spec.k

    @property
    def cfg(self) -> JaxlabConfig:
        return self.target.cfg

    @property
    def max_len(self) -> int:
        return self.target.max_len

    @property
    def stage_lengths(self) -> tuple[int, ...]:
        """A speculative call stages ``max_len`` of each row (see :meth:`init_decode_state`)."""
        return (self.max_len,)

    @property
    def page_size(self) -> int:
        return self.target.page_size

    @property
    def max_pages(self) -> int:
        return self.target.max_pages

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.target.buckets

    @property
    def platform(self) -> str:
        return self.target.platform

    @property
    def precision(self) -> str:
        return self.target.precision

    @property
    def compute_dtype(self) -> str:
        return self.target.compute_dtype

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def step_weight_bytes(self) -> int:
        return self.target.step_weight_bytes

    @property
    def cache_bytes_per_slot(self) -> int:
        return self.target.cache_bytes_per_slot

    @property
    def compiles(self) -> dict[str, int]:
        return self.target.compiles

    @property
    def compile_log(self) -> list[CompileTiming]:
        return self.target.compile_log

    @property
    def compile_seconds(self) -> float:
        return self.target.compile_seconds

    @property
    def compile_cache_hits(self) -> int:
        return self.target.compile_cache_hits

    def limits(self, eos_id: int | None = None) -> Limits:
        return self.target.limits(eos_id)

    def pool_pages(self, slots: int, groups: int = 1) -> int:
        return self.target.pool_pages(slots, groups)

    def bucket_for(self, n_tokens: int) -> int:
        return self.target.bucket_for(n_tokens)

    def naive(self) -> NaiveEngine:
        """The cache-free baseline (it does not speculate)."""
        return self.target.naive()

    # ------------------------------------------------------------------ the verbs

    def init_decode_state(self, slots: int, num_pages: int | None = None) -> SpecState:
        """The target's empty state, a zero token pool and zero draft pools of the same
        pages, every row's counters at zero. The target state carries no ``span``: a
        speculative call stages ``max_len`` (it would key every speculative executable)."""
        target = dataclasses.replace(self.target.init_decode_state(slots, num_pages), span=None)
        n = target.cache.num_pages
        zeros = self._zeros.get(n)
        if zeros is None:
            draft, ps, max_len = self.draft, self.page_size, self.max_len

            def zero(table: Array) -> tuple[Array, tuple[PagedCache, ...]]:
                history = jnp.zeros((n, ps), jnp.int32)
                if draft is None:
                    return history, ()
                pools = nnx.merge(draft.graphdef, draft.params).init_pages(1, n, ps, max_len)
                return history, pools.pools

            zeros = self.target.track(ShapeKeyedJit(zero, name="spec_init"))
            self._zeros[n] = zeros
        history, draft_pools = zeros(target.table)
        return SpecState(
            target=target,
            history=history,
            draft=draft_pools,
            drafted=put(np.zeros((slots,), np.int32)),
            accepted=put(np.zeros((slots,), np.int32)),
            on=put(np.ones((slots,), np.bool_)),
        )

    def set_table(self, state: SpecState, table: np.ndarray) -> SpecState:
        """The page table onto the device (every pool of the state follows it)."""
        target = self.target.set_table(state.target, table)
        return dataclasses.replace(state, target=dataclasses.replace(target, span=None))

    def prefill(
        self,
        state: SpecState,
        chunks: Sequence[Chunk],
        *,
        bucket: int | None = None,
        params: nnx.State | None = None,
    ) -> tuple[SpecState, Prefill]:
        """The target's prefill, then the chunks' token ids into the token pool and, with a
        draft model, their draft K/V into its pools."""
        target, pre = self.target.prefill(state.target, chunks, bucket=bucket, params=params)
        assert pre.bucket is not None
        batch = batch_chunks(
            chunks,
            pre.bucket,
            max_len=self.max_len,
            page_size=self.page_size,
            max_pages=self.max_pages,
            num_pages=target.cache.num_pages,
        )
        history, draft_pools = self._prefill[batch.from_start](
            None if self.draft is None else self.draft.weights(),
            state.draft,
            state.history,
            put(batch.tokens),
            put(batch.starts),
            put(batch.lengths),
            put(batch.table),
        )
        return SpecState(target, history, draft_pools, state.drafted, state.accepted, state.on), pre

    def insert(self, prefix: Prefill, state: SpecState, slots: Sequence[int]) -> SpecState:
        """:meth:`Engine.insert <jaxlab.infer.engine.Engine.insert>`, each chosen slot's
        counters reset."""
        rows = self.target.insert_rows(prefix, state.slots, slots)
        return self._insert(prefix.state, state, put(rows))

    def generate(
        self, state: SpecState, n: int | None = None, *, params: nnx.State | None = None
    ) -> tuple[SpecState, Array, Array, SpecStats]:
        """Speculative decode steps until every row is done or emitted ``n`` tokens
        (default ``inference.stream_chunk_tokens``) in this call; ``(state, tokens i32[n,
        slots], done bool[slots], stats)`` as device arrays (``state`` is donated)."""
        n = n or self.cfg.inference.stream_chunk_tokens
        fn = self._generate.get(n)
        if fn is None:
            tuning = self.target.tuning
            step = make_spec_generate(
                self.target.graphdef,
                None if self.draft is None else self.draft.graphdef,
                self.spec_params,
                n,
                buckets=tuning.row_buckets,
                staged=tuning.staged_pages,
            )
            fn = self.target.track(ShapeKeyedJit(step, name="spec_generate", donate_argnums=(2,)))
            self._generate[n] = fn
        draft = None if self.draft is None else self.draft.weights()
        return fn(self.target.weights(params), draft, state)


def is_speculative(engine: Any) -> bool:
    return isinstance(engine, SpeculativeEngine)


def with_speculation(
    engine: Engine, spec: SpeculativeConfig, tokenizer: Tokenizer
) -> Engine | SpeculativeEngine:
    """``engine`` as ``spec`` asks: itself (method ``off``), or speculating by prompt lookup
    or with the draft run of ``spec.draft_run_dir`` (loaded and checked against
    ``tokenizer``: :func:`~jaxlab.infer.speculative.load_draft`)."""
    if spec.method == "off":
        return engine
    draft = None
    if spec.method == "draft":
        from jaxlab.infer.speculative.draft import load_draft

        assert spec.draft_run_dir is not None  # the config checks it
        draft = load_draft(spec.draft_run_dir, engine, tokenizer)
    return SpeculativeEngine(engine, spec, draft)


__all__ = ["SpeculativeEngine", "is_speculative", "spec_params", "with_speculation"]
