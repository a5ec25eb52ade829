"""The inference engine: a device API of four verbs, shaped like JetStream's ``engine_api``.

::

    engine = Engine(run.graphdef, run.params, run.cfg)       # or Engine.from_config(cfg)
    state = engine.init_decode_state(slots=4)                  # every slot empty (done)
    pre = engine.prefill([ids_a, ids_b], [sampling_a, sampling_b])
    state = engine.insert(pre.state, state, slots=[2, 0])      # prefix rows -> slots
    state, tokens, done = engine.generate(state, k=8)          # <= k tokens per slot

The caller holds the decode state; the engine holds the weights and the compiled
functions. It knows nothing of text, checkpoints, requests' lifetimes or threads: offline
generation (:mod:`jaxlab.infer.offline`) and the server's scheduler (:mod:`jaxlab.serve`)
are written against these verbs alone, and the cache-free baseline
(:class:`~jaxlab.infer.naive.NaiveEngine`) implements the same ones.

Every jitted function is a :class:`ShapeKeyedJit`, so compiles are explicit, timed and
counted (:attr:`Engine.compiles`): ``prefill`` once per (bucket, rows), ``generate`` once
per (k, slots), ``insert`` once per (prefix rows, slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxlab.config.schema import JaxlabConfig
from jaxlab.infer.request import Limits, RequestTooLong
from jaxlab.infer.sampling import SamplingParams, empty_sampling_arrays, sampling_arrays
from jaxlab.infer.state import DecodeState
from jaxlab.infer.steps import (
    Weights,
    make_generate,
    make_insert,
    make_prefill,
    prepare_weights,
    step_weight_bytes,
)
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
    prompt), each row's first sampled token and whether it already finished (device
    arrays), and the bucket the prompts were padded to (None: not bucketed)."""

    state: Any
    tokens: Array
    done: Array
    bucket: int | None


def put(x: np.ndarray) -> Array:
    """Host -> device without a compile (``jnp.asarray`` stages a tiny jit per signature)."""
    return jax.device_put(x)


class Engine:
    """Weights, config and the compiled entry points of one model (module docstring).

    Args:
      graphdef, params: the model (``split_model``); ``params`` are never donated.
        Assigning ``engine.params`` also rebuilds the decode weights (:meth:`weights`).
      cfg: the resolved config; ``model``, ``train.precision`` and ``inference`` are used.
    """

    def __init__(self, graphdef: nnx.GraphDef, params: nnx.State, cfg: JaxlabConfig) -> None:
        if cfg.model.scan_layers:  # decode the unrolled model: no per-step weight slices
            graphdef, params = unstack_params(cfg.model, cfg.train.precision, params)
        self.graphdef = graphdef
        self.cfg = cfg
        self.platform: str = jax.default_backend()
        self.tuning = tuning.current()
        self.params = params  # also prepares the decode weights
        inf = cfg.inference
        self.max_len: int = inf.max_len or cfg.model.max_seq_len
        buckets = sorted(set(inf.prefill_buckets or default_buckets(self.max_len)))
        if buckets[-1] != self.max_len:
            buckets.append(self.max_len)  # every prompt that fits has a bucket
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.compute_dtype = str(cfg.train.precision.compute_dtype)
        model = nnx.merge(graphdef, params)
        self.kernel: str = model.blocks[0].attn.kernel_name
        kernels = [block.attn.kernel for block in model.blocks]
        self._empty_cache = jax.eval_shape(lambda: model.init_cache(1, self.max_len))
        self._prefill = ShapeKeyedJit(
            make_prefill(graphdef, self.max_len),
            name="prefill",
            warn_on_recompile=False,  # once per (bucket, rows) by design
        )
        self._insert = ShapeKeyedJit(
            make_insert(kernels), name="insert", donate_argnums=(1,), warn_on_recompile=False
        )
        self._generate: dict[int, ShapeKeyedJit] = {}
        self._jitted: list[ShapeKeyedJit] = [self._prefill, self._insert]
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
        self._params = self._unrolled(params)
        self._weights = prepare_weights(self.graphdef, self._params, self.tuning.transposed_head)

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
        params = self._unrolled(params)
        return prepare_weights(self.graphdef, params, self.tuning.transposed_head)

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights each decode step reads (:func:`~jaxlab.infer.steps.step_weight_bytes`)."""
        return step_weight_bytes(self.graphdef, self._weights)

    @property
    def cache_bytes_per_slot(self) -> int:
        """Bytes of one slot's KV cache: every layer's K and V at ``max_len`` positions, in
        the cache's dtype (the compute dtype). Every kernel's layout holds exactly these
        (none pads), so this is from the config alone."""
        m = self.cfg.model
        itemsize = jax.numpy.dtype(self.compute_dtype).itemsize
        return 2 * m.n_layers * m.n_kv_heads * m.head_dim * itemsize * self.max_len

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
        if self._naive is None:
            from jaxlab.infer.naive import NaiveEngine

            self._naive = NaiveEngine(self)
        return self._naive

    def track(self, fn: ShapeKeyedJit) -> ShapeKeyedJit:
        """Count ``fn``'s compiles with the engine's (for engines built on this one)."""
        self._jitted.append(fn)
        return fn

    # ------------------------------------------------------------------ the four verbs

    def init_decode_state(self, slots: int) -> DecodeState:
        """A decode state of ``slots`` rows, every one empty (done), over a zero cache."""

        def zeros(a: jax.ShapeDtypeStruct) -> Array:  # host zeros: no per-shape compile
            return put(np.zeros((a.shape[0] * slots, *a.shape[1:]), a.dtype))

        # Distinct buffers everywhere: the state is donated, and a buffer may be donated once.
        return DecodeState(
            cache=jax.tree.map(zeros, self._empty_cache),
            tokens=put(np.zeros((slots,), np.int32)),
            pos=put(np.zeros((slots,), np.int32)),
            generated=put(np.zeros((slots,), np.int32)),
            done=put(np.ones((slots,), np.bool_)),
            sampling=empty_sampling_arrays(slots),
            max_len=self.max_len,
        )

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        *,
        bucket: int | None = None,
        params: nnx.State | None = None,
    ) -> Prefill:
        """Prefill ragged ``prompts`` (checked token ids) together, right-padded to one
        bucket (default: the smallest configured one that holds the longest)."""
        lengths = [len(p) for p in prompts]
        if bucket is None:
            bucket = self.bucket_for(max(lengths))
        elif not max(lengths) <= bucket <= self.max_len:
            raise ValueError(
                f"bucket {bucket} must hold the longest prompt ({max(lengths)}) and be <= "
                f"inference.max_len = {self.max_len}"
            )
        tokens = np.zeros((len(prompts), bucket), np.int32)  # right padding (id 0, invisible)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        state = self._prefill(
            self.weights(params),
            put(tokens),
            put(np.array(lengths, np.int32)),
            sampling_arrays(samplings),
        )
        return Prefill(state, state.tokens, state.done, bucket)

    def insert(self, prefix: DecodeState, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Row ``i`` of ``prefix`` into slot ``slots[i]`` of ``state`` (donated); ``-1`` skips a
        row (padding, or a request finished in prefill). Slots must be distinct."""
        if len(slots) != prefix.slots:
            raise ValueError(f"{len(slots)} slots for a prefix of {prefix.slots} rows")
        chosen = [s for s in slots if s >= 0]
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        bad = [s for s in chosen if s >= state.slots]
        if bad:
            raise IndexError(f"slot {bad[0]} out of range for {state.slots} slots")
        return self._insert(prefix, state, put(np.asarray(slots, np.int32)))

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
        fn = self._generate.get(k)
        if fn is None:
            step = make_generate(self.graphdef, k, buckets=self.tuning.row_buckets)
            fn = self.track(ShapeKeyedJit(step, name="generate", donate_argnums=(1,)))
            self._generate[k] = fn
        return fn(self.weights(params), state)


__all__ = ["Engine", "Prefill", "default_buckets", "put"]
