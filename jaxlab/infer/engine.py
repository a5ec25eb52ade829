"""The inference engine: JetStream-style prefill / insert / generate_chunk, and offline generate.

Building blocks (a continuous-batching server composes these)::

    engine = Engine.from_run_dir("artifacts/runs/demo")
    state = engine.init_decode_state(slots=4)                  # all slots empty (done)
    prefix = engine.prefill(ids, SamplingParams(...))          # one-row state + 1st token
    first = int(prefix.tokens[0])
    state = engine.insert(prefix, state, slot=2)               # compiled once, state donated
    state, tokens, done = engine.generate_chunk(state, k=8)    # <= k tokens per slot

Offline: ``engine.generate([Request(...), ...])`` prefills the batch at once (ragged,
right-padded to one bucket) and runs the decode loop to completion in one jitted call.

Every jitted entry point is a :class:`ShapeKeyedJit`; :attr:`Engine.compiles` counts
executables per function (``prefill`` once per (bucket, batch), ``decode`` once per
(chunk length, slots), ``insert`` once per slot count, ``insert_rows`` once per (prefix
rows, slots)). A server admitting several requests at once prefills them as one ragged
batch and scatters the rows into their slots with one ``insert_rows``.
"""

from __future__ import annotations

import codecs
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlab.config.schema import JaxlabConfig
from jaxlab.infer.core import (
    NO_TOKEN,
    Weights,
    insert,
    insert_rows,
    make_naive_decode,
    make_prefill,
    naive_step,
    step_weight_bytes,
    weights_for,
)
from jaxlab.infer.fused import make_decode
from jaxlab.infer.sampling import SamplingParams, sampling_arrays
from jaxlab.infer.state import DecodeState, NaiveState, Prefix, empty_decode_state
from jaxlab.model import make_model, split_model
from jaxlab.runtime.compiled import CompileTiming, ShapeKeyedJit
from jaxlab.tokenizer import Tokenizer

Array = jax.Array
FinishReason = Literal["stop", "length"]

#: Smallest default prefill bucket: shorter prompts pad up to it (a few padded tokens cost
#: nothing measurable; every bucket costs a compile).
MIN_DEFAULT_BUCKET = 16


class RequestTooLong(ValueError):
    """A request's prompt plus ``max_new_tokens`` does not fit ``inference.max_len``."""


class BadRequest(ValueError):
    """A request that can never run (empty prompt, bad ids or sampling parameters)."""


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


@dataclass(frozen=True)
class Request:
    """One generation request: text (needs a tokenizer) or token ids, and its sampling."""

    prompt: str | Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Result:
    """One request's output. ``token_ids`` exclude the stop/EOS token that ended it."""

    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    finish_reason: FinishReason

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Generation(Sequence[Result]):
    """The results of one ``generate`` call (a sequence of :class:`Result`) and its timings.

    Times exclude compilation (``compile_s``, which covers the executables this call had to
    build). ``ttft_s``: from the ``generate``/``stream`` call to the first tokens on the host
    (tokenize, checks, batching, prefill); ``prefill_s``: the prefill dispatch and its
    result's copy to the host; ``decode_s``: first tokens to last tokens on the host.
    """

    results: list[Result]
    ttft_s: float
    prefill_s: float
    decode_s: float
    compile_s: float
    compiles: dict[str, int]
    bucket: int | None
    kv_cache: bool
    sampled_tokens: int = 0  # including stop tokens: the work the device did

    def __len__(self) -> int:
        return len(self.results)

    def __getitem__(self, i: Any) -> Any:
        return self.results[i]

    def __iter__(self) -> Iterator[Result]:
        return iter(self.results)

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Sampled tokens over ``ttft_s + decode_s`` (prefill included)."""
        return self.sampled_tokens / self.total_s if self.total_s > 0 else float("nan")


@dataclass
class _Row:
    """Host-side bookkeeping of one request during a generation."""

    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class Engine:
    """Holds ``graphdef``/``params``/config/tokenizer and the compiled entry points.

    Args:
      graphdef, params: the model (``split_model``); ``params`` are never donated.
        Assigning ``engine.params`` also rebuilds the cached paths' :class:`Weights`
        (the LM head as a ``[d_model, vocab]`` kernel, see :func:`weights_for`).
      cfg: the resolved config; ``model``, ``train.precision`` and ``inference`` are used.
      tokenizer: needed for text prompts and ``Result.text``; its ``eot_id`` is the EOS.
      checkpoint_step: recorded for reports (``from_run_dir`` sets it).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        cfg: JaxlabConfig,
        tokenizer: Tokenizer | None = None,
        *,
        checkpoint_step: int | None = None,
    ) -> None:
        self.graphdef = graphdef
        self.params = params  # also sets self._weights
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.checkpoint_step = checkpoint_step
        inf = cfg.inference
        self.max_len: int = inf.max_len or cfg.model.max_seq_len
        buckets = sorted(set(inf.prefill_buckets or default_buckets(self.max_len)))
        if buckets[-1] != self.max_len:
            buckets.append(self.max_len)  # every prompt that fits has a bucket
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.param_dtype = str(cfg.train.precision.param_dtype)
        self.compute_dtype = str(cfg.train.precision.compute_dtype)
        self.cache_dtype = jnp.dtype(self.compute_dtype)
        self.eos_id: int | None = tokenizer.eot_id if tokenizer is not None else None
        self.platform: str = jax.default_backend()

        self._prefill = ShapeKeyedJit(
            make_prefill(graphdef, cfg.model, self.max_len, self.cache_dtype),
            name="prefill",
            warn_on_recompile=False,  # once per (bucket, batch) by design
        )
        self._insert = ShapeKeyedJit(insert, name="insert", donate_argnums=(1,))
        self._insert_rows = ShapeKeyedJit(insert_rows, name="insert_rows", donate_argnums=(1,))
        self._decode: dict[int, ShapeKeyedJit] = {}

        def naive_first(p: nnx.State, s: NaiveState) -> tuple[NaiveState, Array]:
            new, _, emitted = naive_step(graphdef, p, s)
            return new, emitted

        self._naive_prefill = ShapeKeyedJit(naive_first, name="naive_prefill", donate_argnums=(1,))
        self._naive_decode: dict[int, ShapeKeyedJit] = {}

    @property
    def params(self) -> nnx.State:
        return self._params

    @params.setter
    def params(self, params: nnx.State) -> None:
        self._params = params
        self._weights = weights_for(self.graphdef, params)

    def weights(self, params: nnx.State | None = None) -> Weights:
        """What prefill and decode read: the engine's (prepared once) or ``params``'."""
        if params is None or params is self._params:
            return self._weights
        return weights_for(self.graphdef, params)

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights each cached decode step reads (:func:`step_weight_bytes`)."""
        return step_weight_bytes(self.graphdef, self._weights)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        cfg: JaxlabConfig,
        *,
        seed: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> Engine:
        """A randomly initialised model of ``cfg.model`` (benchmarks, tests)."""
        model = make_model(
            cfg.model, cfg.train.precision, seed=cfg.runtime.seed if seed is None else seed
        )
        graphdef, params = split_model(model)
        return cls(graphdef, params, cfg, tokenizer)

    @classmethod
    def from_run_dir(
        cls,
        run_dir: str | Path,
        step: int | None = None,
        *,
        cfg: JaxlabConfig | None = None,
    ) -> Engine:
        """Restore the params of ``step`` (None = latest) of a training run, and its tokenizer.

        The checkpoint is self-contained: its ``meta`` holds the config (TOML) and the
        tokenizer files. ``cfg`` overrides the config (e.g. other ``inference.*``); its
        model section must match the checkpoint's.
        """
        from jaxlab.checkpoint import Checkpointer
        from jaxlab.config import from_toml
        from jaxlab.train.optimizer import make_optimizer
        from jaxlab.train.run_dir import RunDir
        from jaxlab.train.step import init_state

        rd = RunDir(run_dir)
        if not rd.checkpoint_dir.is_dir():
            raise FileNotFoundError(f"{run_dir}: not a run directory (no checkpoints/)")
        with _quiet_orbax():
            ck = Checkpointer(rd.checkpoint_dir, read_only=True)
        try:
            resolved = ck.resolve_step(step)
            meta = ck.restore_meta(resolved)
            saved_cfg = from_toml(meta["config"]) if "config" in meta else rd.load_config()
            if cfg is None:
                cfg = saved_cfg
            elif cfg.model != saved_cfg.model:
                raise ValueError("cfg.model differs from the checkpoint's model config")
            tokenizer = _load_tokenizer(meta, rd.tokenizer_dir)

            abstract_model = nnx.eval_shape(lambda: make_model(cfg.model, cfg.train.precision, 0))
            graphdef, abstract_params = split_model(abstract_model)
            tx = make_optimizer(cfg.train)
            abstract_state = jax.eval_shape(lambda p: init_state(p, tx, 0), abstract_params)
            device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            abstract_state = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract_state
            )
            with _quiet_orbax():
                state, _ = ck.restore(resolved, abstract_state)
        finally:
            ck.close()
        return cls(
            graphdef,
            state["params"],
            cfg,
            tokenizer,
            checkpoint_step=resolved,
        )

    # ------------------------------------------------------------------ facts

    @property
    def precision(self) -> str:
        """The compute dtype (``train.precision.compute_dtype``); params are ``param_dtype``."""
        return self.compute_dtype

    @property
    def compiles(self) -> dict[str, int]:
        """Executables built so far, per jitted function."""
        return {
            "prefill": self._prefill.compiles,
            "decode": sum(f.compiles for f in self._decode.values()),
            "insert": self._insert.compiles,
            "insert_rows": self._insert_rows.compiles,
            "naive_prefill": self._naive_prefill.compiles,
            "naive_decode": sum(f.compiles for f in self._naive_decode.values()),
        }

    def _jitted(self) -> list[ShapeKeyedJit]:
        fns = [self._prefill, self._insert, self._insert_rows, self._naive_prefill]
        return [*fns, *self._decode.values(), *self._naive_decode.values()]

    def _compile_s(self) -> float:
        return sum(t.total_s for f in self._jitted() for t in f.timings)

    @property
    def compile_cache_hits(self) -> int:
        """Compiles so far that loaded their executable from the persistent cache."""
        return sum(t.cached for t in self.compile_log)

    @property
    def compile_log(self) -> list[CompileTiming]:
        """Every compile so far (function name, input signature, trace/lower/compile s)."""
        return [t for f in self._jitted() for t in f.timings]

    def bucket_for(self, n_tokens: int) -> int:
        """The smallest prefill bucket holding ``n_tokens``."""
        for b in self.buckets:
            if b >= n_tokens:
                return b
        raise RequestTooLong(
            f"prompt of {n_tokens} tokens exceeds inference.max_len = {self.max_len}"
        )

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest("a text prompt needs a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def check_request(self, ids: Sequence[int], sampling: SamplingParams) -> None:
        """Raise :class:`RequestTooLong` / :class:`BadRequest` for a request that cannot run."""
        try:
            sampling.validate()
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if not ids:
            raise BadRequest("the prompt is empty (0 tokens); give at least one token")
        vocab = self.cfg.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token id {bad[0]} out of range for vocab_size={vocab}")
        stops = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if stops:
            raise BadRequest(f"stop token id {stops[0]} out of range for vocab_size={vocab}")
        need = len(ids) + sampling.max_new_tokens
        if need > self.max_len:
            raise RequestTooLong(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{need} exceeds inference.max_len = {self.max_len}; shorten the prompt, "
                f"lower max_new_tokens or raise inference.max_len"
            )

    def _stops(self, sampling: SamplingParams) -> frozenset[int]:
        extra = () if self.eos_id is None or sampling.ignore_eos else (self.eos_id,)
        return frozenset((*sampling.stop_token_ids, *extra))

    # ------------------------------------------------------------------ building blocks

    def _decode_fn(self, k: int) -> ShapeKeyedJit:
        fn = self._decode.get(k)
        if fn is None:
            fn = ShapeKeyedJit(make_decode(self.graphdef, k), name="decode", donate_argnums=(1,))
            self._decode[k] = fn
        return fn

    def _naive_decode_fn(self, k: int) -> ShapeKeyedJit:
        fn = self._naive_decode.get(k)
        if fn is None:
            fn = ShapeKeyedJit(
                make_naive_decode(self.graphdef, k), name="naive_decode", donate_argnums=(1,)
            )
            self._naive_decode[k] = fn
        return fn

    def _prefill_args(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        bucket: int | None = None,
    ) -> tuple[int, tuple[Array, Array, Any]]:
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
        sp = sampling_arrays(samplings, self.eos_id)
        return bucket, (_put(tokens), _put(np.array(lengths, np.int32)), sp)

    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        *,
        params: nnx.State | None = None,
        bucket: int | None = None,
    ) -> tuple[DecodeState, int]:
        """Prefill ragged ``prompts`` (token ids) together: ``(state with B rows, bucket)``.

        The state's ``tokens`` are the first sampled tokens, ``done`` whether a row already
        finished. Requests must have been checked (:meth:`check_request`). ``bucket``
        overrides the padded length (default: the smallest configured bucket that fits).
        """
        bucket, args = self._prefill_args(prompts, samplings, bucket)
        state = self._prefill(self.weights(params), *args)
        return state, bucket

    def prefill(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        params: nnx.State | None = None,
    ) -> Prefix:
        """One prompt -> a :data:`Prefix` (one-row cache, first token, length, sampling)."""
        sampling = sampling or SamplingParams.from_config(self.cfg.inference)
        ids = self.encode(prompt)
        self.check_request(ids, sampling)
        state, _ = self.prefill_batch([ids], [sampling], params=params)
        return state

    def init_decode_state(self, slots: int) -> DecodeState:
        """A batched decode state with every slot empty."""
        m = self.cfg.model
        return empty_decode_state(
            slots, m.n_layers, m.n_kv_heads, self.max_len, m.head_dim, self.cache_dtype
        )

    def insert(self, prefix: Prefix, state: DecodeState, slot: int) -> DecodeState:
        """Copy ``prefix`` into slot ``slot`` of ``state`` (donated; compiled once)."""
        if not 0 <= slot < state.slots:
            raise IndexError(f"slot {slot} out of range for {state.slots} slots")
        return self._insert(prefix, state, _put(np.asarray(slot, np.int32)))

    def insert_rows(
        self, prefix: DecodeState, state: DecodeState, slots: Sequence[int]
    ) -> DecodeState:
        """Copy row ``i`` of a batched ``prefix`` (:meth:`prefill_batch`) into ``slots[i]``.

        ``-1`` skips a row (padding, or finished in prefill); slots must be distinct.
        ``state`` is donated; compiled once per number of prefix rows.
        """
        if len(slots) != prefix.slots:
            raise ValueError(f"{len(slots)} slots for a prefix of {prefix.slots} rows")
        chosen = [s for s in slots if s >= 0]
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        bad = [s for s in chosen if s >= state.slots]
        if bad:
            raise IndexError(f"slot {bad[0]} out of range for {state.slots} slots")
        return self._insert_rows(prefix, state, _put(np.asarray(slots, np.int32)))

    def generate_chunk(
        self, state: DecodeState, k: int | None = None, *, params: nnx.State | None = None
    ) -> tuple[DecodeState, Array, Array]:
        """Up to ``k`` decode steps in one jitted ``while_loop`` (``state`` is donated).

        Returns ``(state, tokens i32[k, slots], done bool[slots])`` as device arrays;
        ``tokens[i, s]`` is slot ``s``'s token of step ``i`` or ``-1`` (slot idle or done).
        The loop stops early when every slot is done. ``k`` defaults to
        ``inference.stream_chunk_tokens``.
        """
        k = k or self.cfg.inference.stream_chunk_tokens
        return self._decode_fn(k)(self.weights(params), state)

    # ------------------------------------------------------------------ offline

    def generate(
        self,
        requests: Sequence[Request | str | Sequence[int]],
        *,
        kv_cache: bool = True,
    ) -> Generation:
        """Generate for every request as one batch; see :meth:`stream` for the details."""
        stream = self.stream(requests, kv_cache=kv_cache, chunk_tokens=self.max_len)
        for _ in stream:
            pass
        assert stream.generation is not None
        return stream.generation

    def stream(
        self,
        requests: Sequence[Request | str | Sequence[int]],
        *,
        kv_cache: bool = True,
        chunk_tokens: int | None = None,
    ) -> Stream:
        """An iterator of per-request new token lists, one item per host round trip.

        The first item holds the prefill's tokens; each later one up to ``chunk_tokens``
        (default ``inference.stream_chunk_tokens``) decode steps. Stop/EOS tokens are never
        yielded. After iteration ``stream.generation`` holds the :class:`Generation`.
        """
        t_call = time.perf_counter()
        reqs = [
            r if isinstance(r, Request) else Request(r, self._default_sampling()) for r in requests
        ]
        if not reqs:
            raise BadRequest("no requests")
        ids = [self.encode(r.prompt) for r in reqs]
        for i, r in zip(ids, reqs, strict=True):
            self.check_request(i, r.sampling)
        k = chunk_tokens or self.cfg.inference.stream_chunk_tokens
        return Stream(self, reqs, ids, kv_cache, k, t_call)

    def _default_sampling(self) -> SamplingParams:
        return SamplingParams.from_config(self.cfg.inference)

    def _naive_state(
        self, prompts: Sequence[Sequence[int]], samplings: Sequence[SamplingParams]
    ) -> NaiveState:
        b = len(prompts)
        buf = np.zeros((b, self.max_len), np.int32)
        for i, p in enumerate(prompts):
            buf[i, : len(p)] = p
        return NaiveState(
            buf=_put(buf),
            pos=_put(np.array([len(p) - 1 for p in prompts], np.int32)),
            generated=_put(np.zeros((b,), np.int32)),
            done=_put(np.zeros((b,), np.bool_)),
            sampling=sampling_arrays(samplings, self.eos_id),
        )


class Stream:
    """Iterates over one batch's new tokens (``list[list[int]]`` per round trip)."""

    def __init__(
        self,
        engine: Engine,
        requests: list[Request],
        ids: list[list[int]],
        kv_cache: bool,
        chunk_tokens: int,
        t_call: float,
    ) -> None:
        self.engine = engine
        self.t_call = t_call
        self.requests = requests
        self.ids = ids
        self.kv_cache = kv_cache
        self.chunk_tokens = chunk_tokens
        self.generation: Generation | None = None
        self.rows = [_Row(engine._stops(r.sampling)) for r in requests]
        self._it = self._run()

    def __iter__(self) -> Iterator[list[list[int]]]:
        return self._it

    def __next__(self) -> list[list[int]]:
        return next(self._it)

    def _take(self, tokens: np.ndarray, done: np.ndarray) -> list[list[int]]:
        """Append ``tokens [steps, B]`` to the rows; return each row's new visible tokens."""
        new: list[list[int]] = []
        for b, row in enumerate(self.rows):
            fresh = [int(t) for t in tokens[:, b] if t != NO_TOKEN]
            row.tokens.extend(fresh)
            row.done = bool(done[b])
            if row.done and fresh and fresh[-1] in row.stops:
                fresh = fresh[:-1]
            new.append(fresh)
        return new

    def _run(self) -> Iterator[list[list[int]]]:
        eng = self.engine
        params = eng.params
        weights = eng.weights()
        samplings = [r.sampling for r in self.requests]
        compile_before = eng._compile_s()
        t_call = self.t_call
        bucket: int | None
        compile_s = 0.0
        if self.kv_cache:
            bucket, args = eng._prefill_args(self.ids, samplings)
            eng._prefill.compile_for(weights, *args)
            compile_s = eng._compile_s() - compile_before
            t0 = time.perf_counter()
            state = eng._prefill(weights, *args)
            first, done = jax.device_get((state.tokens, state.done))
            decode_fn = eng._decode_fn(self.chunk_tokens)
            cur, step_args = state, weights
        else:
            bucket = None
            nstate = eng._naive_state(self.ids, samplings)
            eng._naive_prefill.compile_for(params, nstate)
            compile_s = eng._compile_s() - compile_before
            t0 = time.perf_counter()
            nstate, first = eng._naive_prefill(params, nstate)
            first, done = jax.device_get((first, nstate.done))
            decode_fn = eng._naive_decode_fn(self.chunk_tokens)
            cur, step_args = nstate, params
        t1 = time.perf_counter()
        prefill_s = t1 - t0
        ttft_s = t1 - t_call - compile_s
        yield self._take(np.asarray(first)[None, :], np.asarray(done))

        decode_s = 0.0
        while not all(r.done for r in self.rows):
            c0 = eng._compile_s()
            decode_fn.compile_for(step_args, cur)
            dc = eng._compile_s() - c0
            compile_s += dc
            t2 = time.perf_counter()
            cur, out, done = decode_fn(step_args, cur)
            out, done = jax.device_get((out, done))
            decode_s += time.perf_counter() - t2
            yield self._take(np.asarray(out), np.asarray(done))

        results = []
        for row, ids in zip(self.rows, self.ids, strict=True):
            stopped = bool(row.tokens) and row.tokens[-1] in row.stops
            toks = row.tokens[:-1] if stopped else list(row.tokens)
            text = eng.tokenizer.decode(toks) if eng.tokenizer is not None else None
            results.append(Result(toks, text, len(ids), "stop" if stopped else "length"))
        self.generation = Generation(
            results=results,
            ttft_s=ttft_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            compile_s=compile_s,
            compiles=eng.compiles,
            bucket=bucket,
            kv_cache=self.kv_cache,
            sampled_tokens=sum(len(r.tokens) for r in self.rows),
        )


class Utf8Stream:
    """Turns token ids into text incrementally, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> str:
        return self._dec.decode(self.tokenizer.decode_bytes(ids)) if ids else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


@contextmanager
def _quiet_orbax() -> Iterator[None]:
    """Orbax warns (via absl) that a read-only manager ignores its save options: expected."""
    absl = logging.getLogger("absl")
    old = absl.level
    if absl.getEffectiveLevel() > logging.DEBUG:
        absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(old)


def _put(x: np.ndarray) -> Array:
    """Host -> device without a compile (``jnp.asarray`` stages a tiny jit per signature)."""
    return jax.device_put(x)


def _load_tokenizer(meta: dict[str, Any], fallback_dir: Path) -> Tokenizer:
    files = meta.get("tokenizer")
    if isinstance(files, dict) and files:
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in files.items():
                (Path(tmp) / Path(name).name).write_text(text)
            return Tokenizer.load(tmp)
    return Tokenizer.load(fallback_dir)


__all__ = [
    "BadRequest",
    "Engine",
    "Generation",
    "Request",
    "RequestTooLong",
    "Result",
    "Stream",
    "Utf8Stream",
    "default_buckets",
]
