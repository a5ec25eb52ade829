"""The inference engine: a device API of a few verbs, shaped like JetStream's ``engine_api``,
over a paged KV cache.

::

    engine = Engine(run.graphdef, run.params, run.cfg)       # or Engine.from_config(cfg)
    state = engine.init_decode_state(slots=4)                  # a pool of pages, every slot empty
    state = engine.set_table(state, table)                     # host page table -> device
    state, pre = engine.prefill(state, [Chunk(ids, 0, pages, sampling)])   # K/V into pages
    state = engine.insert(pre, state, slots=[2])               # prefix rows -> slots
    state, tokens, done = engine.generate(state, k=8)          # <= k tokens per slot

The caller holds the decode state and decides which pages each sequence holds (a
:class:`~jaxlab.infer.pages.PagePool`); the engine holds the weights and the compiled
functions, and follows the page table it is given. It knows nothing of text,
checkpoints, requests' lifetimes or threads: offline generation
(:mod:`jaxlab.infer.offline`) and the server's scheduler (:mod:`jaxlab.serve`) are written
against these verbs alone, and the cache-free baseline
(:class:`~jaxlab.infer.naive.NaiveEngine`) implements the same ones.

Every jitted function is a :class:`ShapeKeyedJit`, so compiles are explicit, timed and
counted (:attr:`Engine.compiles`): for a decode state of a given pool, ``prefill`` once
per (length bucket, row bucket, from-start or not) and its ``first_token`` (the head and
sampling) once per row bucket, ``generate`` once per (k, slots, staged length:
:mod:`jaxlab.kernels.staged`), ``insert`` once per (prefix rows, slots),
``init_decode_state`` once per (slots, pages); ``set_table`` never compiles.

**LoRA adapters** (``Engine(..., adapters=lora.stack(...))``): the engine holds the stacked
adapter weights on the device, every row of the decode state carries an adapter id
(``DecodeState.adapter``, set from its prompt's :attr:`Chunk.adapter` at insert), and
prefill and decode pass ``Lora(weights, scale, ids)`` into the model: rows of different
adapters share one batched step (a gathered low-rank einsum per projection,
:mod:`jaxlab.model.lora`). The adapter count is fixed when the engine is built and the
ids are data, so mixing adapters adds no compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxlab.config.schema import JaxlabConfig
from jaxlab.infer.chunks import Chunk, batch_chunks
from jaxlab.infer.pages import default_num_pages, pages_for_budget
from jaxlab.infer.request import Limits, RequestTooLong
from jaxlab.infer.sampling import empty_sampling_arrays, sampling_arrays
from jaxlab.infer.state import DecodeState
from jaxlab.infer.steps import (
    Adapters,
    Weights,
    make_first_token,
    make_generate,
    make_insert,
    make_prefill,
    prepare_weights,
    step_weight_bytes,
)
from jaxlab.kernels.paged import KV_SCALE_BYTES, PagedCache, Pages, max_pages_for
from jaxlab.kernels.staged import stage_length, stage_lengths
from jaxlab.model import make_model, split_model
from jaxlab.model.transformer import is_stacked, unstack_params
from jaxlab.runtime import tuning
from jaxlab.runtime.compiled import CompileTiming, ShapeKeyedJit

if TYPE_CHECKING:
    from jaxlab.infer.naive import NaiveEngine

Array = jax.Array

#: Smallest default prefill bucket: shorter prompts pad up to it (a few padded tokens cost
#: nothing measurable; every bucket costs a compile).
MIN_DEFAULT_BUCKET = 16


def default_buckets(max_len: int, smallest: int = MIN_DEFAULT_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_len``, and ``max_len`` itself."""
    out: list[int] = []
    b = 1
    while b < max_len:
        if b >= smallest:
            out.append(b)
        b *= 2
    out.append(max_len)
    return out


class Prefill(NamedTuple):
    """What :meth:`Engine.prefill` returns: the prefix (a decode state with one row per
    chunk and no pools), each row's sampled token and whether it already finished
    (device arrays; rows past the chunks are padding, and a chunk that is not its
    prompt's ``last`` has a meaningless token), the bucket the chunks were padded to
    (None: not bucketed), each chunk's ``last`` flag (:meth:`Engine.insert` skips the
    rows whose prompt goes on), and the span of the chunks' page lists
    (``DecodeState.span``; None: not known)."""

    state: Any
    tokens: Array
    done: Array
    bucket: int | None
    last: tuple[bool, ...] = ()
    span: int | None = None


def put(x: np.ndarray) -> Array:
    """Host -> device without a compile (``jnp.asarray`` stages a tiny jit per signature)."""
    return jax.device_put(x)


class Engine:
    """Weights, config and the compiled entry points of one model (module docstring).

    Args:
      graphdef, params: the model (``split_model``); ``params`` are never donated.
        Assigning ``engine.params`` also rebuilds the decode weights (:meth:`weights`).
      cfg: the resolved config; ``model``, ``train.precision`` and ``inference`` are used.
      adapters: LoRA adapters, stacked (:func:`jaxlab.model.lora.stack`: ``(weights,
        scale)``, slot 0 the base model); rows choose one by :attr:`Chunk.adapter`.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        cfg: JaxlabConfig,
        *,
        adapters: tuple[Any, Array] | None = None,
    ) -> None:
        #: The stacked adapters on the device (None: the base model alone).
        self.adapters: Adapters | None = (
            None if adapters is None else Adapters(*jax.device_put(tuple(adapters)))
        )
        if cfg.model.scan_layers:  # decode the unrolled model: no per-step weight slices
            graphdef, params = unstack_params(cfg.model, cfg.train.precision, params)
        self.graphdef = graphdef
        self.cfg = cfg
        self.platform: str = jax.default_backend()
        self.tuning = tuning.current()
        inf = cfg.inference
        #: ``"float"`` or ``"int8"`` (``inference.weights``): what the verbs read.
        self.weights_format: str = inf.weights
        #: ``"int8"``, or the compute dtype's name (``inference.kv_cache_dtype``).
        self.kv_cache_dtype: str = (
            "int8" if inf.kv_cache_dtype == "int8" else str(cfg.train.precision.compute_dtype)
        )
        self.params = params  # also prepares the decode weights (quantized with int8)
        self.max_len: int = inf.max_len or cfg.model.max_seq_len
        buckets = sorted(set(inf.prefill_buckets or default_buckets(self.max_len)))
        if buckets[-1] != self.max_len:
            buckets.append(self.max_len)  # every prompt that fits has a bucket
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.compute_dtype = str(cfg.train.precision.compute_dtype)
        #: Tokens per page, and the pages one sequence of ``max_len`` tokens may hold.
        self.page_size: int = inf.page_size
        self.max_pages: int = max_pages_for(self.max_len, self.page_size)
        self._model = nnx.merge(graphdef, self._params)
        attn = self._model.blocks[0].attn
        self.kernel: str = attn.kernel_name
        self.paged_kernel: str = attn.paged_kernel.name
        # Once per (length bucket, row bucket) of each kind, by design.
        self._prefill = {
            from_start: ShapeKeyedJit(
                make_prefill(graphdef, from_start=from_start),
                name="prefill",
                donate_argnums=(1,),
                warn_on_recompile=False,
            )
            for from_start in (True, False)
        }
        # Once per row bucket: the head and sampling, apart from the prefill's lengths.
        self._first_token = ShapeKeyedJit(
            make_first_token(graphdef, self.max_len), name="first_token", warn_on_recompile=False
        )
        self._insert = ShapeKeyedJit(
            make_insert(), name="insert", donate_argnums=(1,), warn_on_recompile=False
        )
        self._generate: dict[tuple[int, int | None, int], ShapeKeyedJit] = {}
        self._zero_pools: dict[int, ShapeKeyedJit] = {}
        self._jitted: list[ShapeKeyedJit] = [
            *self._prefill.values(),
            self._first_token,
            self._insert,
        ]
        self._naive: NaiveEngine | None = None

    @classmethod
    def from_config(cls, cfg: JaxlabConfig, *, seed: int | None = None) -> Engine:
        """A randomly initialised model of ``cfg.model`` (benchmarks, tests)."""
        seed = cfg.runtime.seed if seed is None else seed
        graphdef, params = split_model(make_model(cfg.model, cfg.train.precision, seed=seed))
        return cls(graphdef, params, cfg)

    # ------------------------------------------------------------------ weights

    @property
    def params(self) -> nnx.State:
        return self._params

    @params.setter
    def params(self, params: nnx.State) -> None:
        # With int8 weights the engine keeps only the quantized dense kernels: ``params``
        # reads back quantized, and the float ones it was given are not held.
        self._weights = self._prepare(self._unrolled(params))
        self._params = self._weights.params

    def _prepare(self, params: nnx.State) -> Weights:
        inf = self.cfg.inference
        w = prepare_weights(
            self.graphdef, params, self.tuning.transposed_head, inf.weights, inf.activations
        )
        return w._replace(adapters=self.adapters)

    @property
    def num_adapters(self) -> int:
        """LoRA adapters served besides the base model (ids ``1 .. num_adapters``)."""
        return 0 if self.adapters is None else self.adapters.count - 1

    def _unrolled(self, params: nnx.State) -> nnx.State:
        """``params`` as the engine's unrolled model has them (a ``scan_layers`` model's
        stacked blocks unstacked)."""
        if is_stacked(params):
            return unstack_params(self.cfg.model, self.cfg.train.precision, params)[1]
        return params

    def weights(self, params: nnx.State | None = None) -> Weights:
        """What prefill and decode read: the engine's (prepared once) or ``params``'."""
        if params is None or params is self._params:
            return self._weights
        return self._prepare(self._unrolled(params))

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights each decode step reads (:func:`~jaxlab.infer.steps.step_weight_bytes`)."""
        return step_weight_bytes(self.graphdef, self._weights)

    @property
    def kv_bytes_per_token_head(self) -> int:
        """Bytes the KV cache holds per token, layer, kv head and K-or-V: ``head_dim``
        values in the cache's dtype (``inference.kv_cache_dtype``), plus a float32 scale
        when they are int8."""
        d = self.cfg.model.head_dim
        if self.kv_cache_dtype == "int8":
            return d + KV_SCALE_BYTES
        return d * jax.numpy.dtype(self.kv_cache_dtype).itemsize

    @property
    def cache_bytes_per_slot(self) -> int:
        """Bytes of one slot's KV cache: every layer's K and V at ``max_len`` positions
        (:attr:`kv_bytes_per_token_head` each). Every kernel's layout holds exactly these
        (none pads), so this is from the config alone."""
        m = self.cfg.model
        return 2 * m.n_layers * m.n_kv_heads * self.kv_bytes_per_token_head * self.max_len

    # ------------------------------------------------------------------ facts

    @property
    def vocab_size(self) -> int:
        return self.cfg.model.vocab_size

    @property
    def precision(self) -> str:
        """The compute dtype (``train.precision.compute_dtype``)."""
        return self.compute_dtype

    def limits(self, eos_id: int | None = None) -> Limits:
        """What a request for this engine is checked against (:meth:`Request.create`)."""
        return Limits(self.vocab_size, self.max_len, eos_id)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of ``page_size`` tokens in every layer."""
        m = self.cfg.model
        return 2 * m.n_layers * self.page_size * m.n_kv_heads * self.kv_bytes_per_token_head

    def pool_pages(self, slots: int, groups: int = 1) -> int:
        """The pages of one decode state of ``slots`` rows, when the configured KV cache is
        split over ``groups`` such states: ``inference.num_pages // groups``, or what
        ``inference.kv_cache_mib / groups`` holds, or by default enough for every slot to
        hold ``max_len`` tokens (the contiguous cache's memory)."""
        inf = self.cfg.inference
        if inf.num_pages is not None:
            n = inf.num_pages // groups
        elif inf.kv_cache_mib is not None:
            m = self.cfg.model
            int8_kv = self.kv_cache_dtype == "int8"
            n = pages_for_budget(
                inf.kv_cache_mib / groups,
                page_size=self.page_size,
                n_layers=m.n_layers,
                n_kv_heads=m.n_kv_heads,
                head_dim=m.head_dim,
                dtype_bytes=1 if int8_kv else jax.numpy.dtype(self.kv_cache_dtype).itemsize,
                scale_bytes=KV_SCALE_BYTES if int8_kv else 0,
            )
        else:
            return default_num_pages(slots, self.max_len, self.page_size)
        if n < 1:
            raise ValueError(f"{groups} decode states leave no page each of {inf.num_pages}")
        return n

    def bucket_for(self, n_tokens: int) -> int:
        """The smallest prefill bucket holding ``n_tokens``."""
        for b in self.buckets:
            if b >= n_tokens:
                return b
        raise RequestTooLong(
            f"prompt of {n_tokens} tokens exceeds inference.max_len = {self.max_len}",
            param="prompt",
        )

    @property
    def compiles(self) -> dict[str, int]:
        """Executables built so far, per jitted function."""
        out: dict[str, int] = {}
        for f in self._jitted:
            out[f.name] = out.get(f.name, 0) + f.compiles
        return out

    @property
    def compile_log(self) -> list[CompileTiming]:
        """Every compile so far (function name, input signature, trace/lower/compile s)."""
        return [t for f in self._jitted for t in f.timings]

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling so far (timings bracket each compile exactly)."""
        return sum(t.total_s for t in self.compile_log)

    @property
    def compile_cache_hits(self) -> int:
        """Compiles so far that loaded their executable from the persistent cache."""
        return sum(t.cached for t in self.compile_log)

    def naive(self) -> NaiveEngine:
        """The cache-free baseline over this engine's model and params (made once)."""
        if self.num_adapters:
            raise ValueError("the cache-free baseline runs the base model only (no adapters)")
        if self._naive is None:
            from jaxlab.infer.naive import NaiveEngine

            self._naive = NaiveEngine(self)
        return self._naive

    def track(self, fn: ShapeKeyedJit) -> ShapeKeyedJit:
        """Count ``fn``'s compiles with the engine's (for engines built on this one)."""
        self._jitted.append(fn)
        return fn

    def decode_unroll(self, slots: int) -> int:
        """Decode steps per loop trip for a state of ``slots`` rows: ``inference.decode_unroll``,
        else two where the tuning unrolls that many rows
        (:attr:`~jaxlab.runtime.tuning.Tuning.unroll_decode_rows`), else one."""
        given = self.cfg.inference.decode_unroll
        if given is not None:
            return given
        return 2 if slots <= self.tuning.unroll_decode_rows else 1

    @property
    def staged(self) -> bool:
        """Whether decode calls stage the pages (:mod:`jaxlab.kernels.staged`): the tuning's
        choice, except for an int8 pool, which is read page by page (the staged cache is
        float)."""
        return self.tuning.staged_pages and self.kv_cache_dtype != "int8"

    @property
    def stage_lengths(self) -> tuple[int, ...]:
        """The lengths a decode call may stage, shortest first (``max_len`` alone where
        calls do not stage): one ``generate`` executable per length used."""
        if not self.staged:
            return (self.max_len,)
        return stage_lengths(self.max_len, self.page_size, self.max_pages)

    def span_of(self, table: np.ndarray, num_pages: int) -> int:
        """``DecodeState.span`` of the host page ``table`` over a pool of ``num_pages``."""
        return stage_length(table, num_pages, self.page_size, self.stage_lengths)

    # ------------------------------------------------------------------ the verbs

    def init_decode_state(self, slots: int, num_pages: int | None = None) -> DecodeState:
        """A decode state of ``slots`` rows, every one empty (done), over a zero pool of
        ``num_pages`` pages (default :meth:`pool_pages`) and a table holding no page
        (every entry ``NO_PAGE = num_pages``). The pools are zeroed on the device (compiled
        once per pool: a memset is cheaper than copying host zeros); the rest comes from
        host arrays."""
        n = self.pool_pages(slots) if num_pages is None else num_pages
        if n < 1:
            raise ValueError(f"a decode state needs at least one page, got num_pages={n}")
        zeros = self._zero_pools.get(n)
        if zeros is None:
            model, ps, max_len = self._model, self.page_size, self.max_len
            dtype = None if self.kv_cache_dtype != "int8" else jax.numpy.int8

            def zero_pools(table: Array) -> tuple[PagedCache, ...]:
                return model.init_pages(table.shape[0], n, ps, max_len, dtype).pools

            zeros = self.track(ShapeKeyedJit(zero_pools, name="init_decode_state"))
            self._zero_pools[n] = zeros
        table = put(np.full((slots, self.max_pages), n, np.int32))
        # Distinct buffers everywhere: the state is donated, and a buffer may be donated once.
        return DecodeState(
            cache=Pages(zeros(table), table),
            tokens=put(np.zeros((slots,), np.int32)),
            pos=put(np.zeros((slots,), np.int32)),
            generated=put(np.zeros((slots,), np.int32)),
            done=put(np.ones((slots,), np.bool_)),
            sampling=empty_sampling_arrays(slots),
            adapter=put(np.zeros((slots,), np.int32)),
            max_len=self.max_len,
            span=self.stage_lengths[0],
        )

    def set_table(self, state: DecodeState, table: np.ndarray) -> DecodeState:
        """``state`` with the host page table ``int32[slots, max_pages]`` (page ids, or
        ``NO_PAGE = num_pages`` for none): a host-to-device copy, no compile. The caller
        gives every active row pages for the positions its next ``generate`` writes."""
        table = np.asarray(table, np.int32)
        n = state.cache.num_pages
        if table.shape != (state.slots, self.max_pages):
            raise ValueError(
                f"page table of shape {table.shape}; expected ({state.slots}, {self.max_pages})"
            )
        if table.size and not (table.min() >= 0 and table.max() <= n):
            raise ValueError(f"page table entries must be page ids 0..{n - 1} or NO_PAGE = {n}")
        return dataclasses.replace(
            state, cache=Pages(state.cache.pools, put(table)), span=self.span_of(table, n)
        )

    def prefill(
        self,
        state: DecodeState,
        chunks: Sequence[Chunk],
        *,
        bucket: int | None = None,
        params: nnx.State | None = None,
    ) -> tuple[DecodeState, Prefill]:
        """Compute ``chunks`` (:class:`~jaxlab.infer.chunks.Chunk`) together and write their
        K/V into ``state``'s pages (the pools are donated; the rest of ``state`` is left as
        it was). The chunks are right-padded to one length bucket (default: the smallest
        configured one that holds the longest) and a power-of-two row count. When every
        chunk starts at position 0 the sequence forward runs (attention over the chunk
        only, as a whole prompt costs); otherwise the model extends each sequence's pages,
        attending to its earlier positions too (chunked prefill, a cached prefix).

        Returns the state and the :class:`Prefill`: each chunk's sampled token (key index
        ``chunk.generated``) for :meth:`insert`."""
        longest = max((len(c.tokens) for c in chunks), default=0)
        bad = [c.adapter for c in chunks if not 0 <= c.adapter <= self.num_adapters]
        if bad:  # a gather would clamp an id out of range: another adapter's output
            raise ValueError(
                f"chunk adapter id {bad[0]} out of range: this engine holds "
                f"{self.num_adapters} adapter(s), ids 0..{self.num_adapters}"
            )
        if bucket is None:
            bucket = self.bucket_for(longest)
        elif not longest <= bucket <= self.max_len:
            raise ValueError(
                f"bucket {bucket} must hold the longest chunk ({longest}) and be <= "
                f"inference.max_len = {self.max_len}"
            )
        batch = batch_chunks(
            chunks,
            bucket,
            max_len=self.max_len,
            page_size=self.page_size,
            max_pages=self.max_pages,
            num_pages=state.cache.num_pages,
        )
        weights = self.weights(params)
        starts, lengths, table, adapters = (
            put(batch.starts),
            put(batch.lengths),
            put(batch.table),
            put(batch.adapters),
        )
        pools, last = self._prefill[batch.from_start](
            weights, state.cache.pools, put(batch.tokens), starts, lengths, table, adapters
        )
        prefix = self._first_token(
            weights,
            last,
            starts,
            lengths,
            table,
            put(batch.generated),
            adapters,
            sampling_arrays(batch.samplings),
        )
        state = dataclasses.replace(state, cache=Pages(pools, state.cache.table))
        last = tuple(c.last for c in chunks)
        span = self.span_of(batch.table, state.cache.num_pages)
        return state, Prefill(prefix, prefix.tokens, prefix.done, bucket, last, span)

    def insert(self, prefix: Prefill, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Row ``i`` of ``prefix`` (chunk ``i``) into slot ``slots[i]`` of ``state`` (donated),
        its page-table row included; ``-1`` skips a row (a request that finished in
        prefill), and so does every chunk that is not its prompt's ``last``. Slots must be
        distinct."""
        rows = put(self.insert_rows(prefix, state.slots, slots))
        out = self._insert(prefix.state, dataclasses.replace(state, span=None), rows)
        span = None if state.span is None or prefix.span is None else max(state.span, prefix.span)
        return dataclasses.replace(out, span=span)

    @staticmethod
    def insert_rows(prefix: Prefill, n_slots: int, slots: Sequence[int]) -> np.ndarray:
        """The slot of each prefix row (``-1``: skipped), checked: what :meth:`insert`
        scatters by."""
        if len(slots) != len(prefix.last):
            raise ValueError(f"{len(slots)} slots for a prefill of {len(prefix.last)} chunks")
        chosen = [s for s, last in zip(slots, prefix.last, strict=True) if last and s >= 0]
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        bad = [s for s in chosen if s >= n_slots]
        if bad:
            raise IndexError(f"slot {bad[0]} out of range for {n_slots} slots")
        rows = [s if last else -1 for s, last in zip(slots, prefix.last, strict=True)]
        rows += [-1] * (prefix.state.slots - len(rows))  # padding rows
        return np.asarray(rows, np.int32)

    def generate(
        self, state: DecodeState, k: int | None = None, *, params: nnx.State | None = None
    ) -> tuple[DecodeState, Array, Array]:
        """Up to ``k`` decode steps for every slot in one jitted loop (``state`` donated).

        Returns ``(state, tokens i32[k, slots], done bool[slots])`` as device arrays;
        ``tokens[i, s]`` is slot ``s``'s token of step ``i`` or ``-1`` (idle, or done). The
        loop stops early once every slot is done. ``k`` defaults to
        ``inference.stream_chunk_tokens``.
        """
        k = k or self.cfg.inference.stream_chunk_tokens
        stage = state.staged_len if self.staged else None
        unroll = self.decode_unroll(state.slots)
        fn = self._generate.get((k, stage, unroll))
        if fn is None:
            step = make_generate(
                self.graphdef,
                k,
                buckets=self.tuning.row_buckets,
                staged=self.staged,
                stage_len=stage,
                unroll=unroll,
            )
            fn = self.track(ShapeKeyedJit(step, name="generate", donate_argnums=(1,)))
            self._generate[(k, stage, unroll)] = fn
        # The span keys the executable beside k; it is not the executable's input.
        out, tokens, done = fn(self.weights(params), dataclasses.replace(state, span=None))
        return dataclasses.replace(out, span=state.span), tokens, done


__all__ = ["Chunk", "Engine", "Prefill", "default_buckets", "put"]
