"""Offline generation: a batch of requests run to completion, or streamed chunk by chunk.

Written against the engine's public verbs only (``init_decode_state``, ``prefill``,
``insert``, then ``generate`` in chunks), so the cache-free baseline runs through the very
same code::

    gen = generate(engine, requests)                      # KV-cached, paged
    gen = generate(engine, requests, kv_cache=False)      # NaiveEngine: full prefix per step
    for new in (s := stream(engine, requests, chunk_tokens=8)): ...

The batch gets a decode state of its own, one row per request, over a pool of
``len(requests) * max_pages`` pages (the contiguous cache's memory, so every batch of
checked requests fits, and the pool's shape, hence the compiled programs, depend on the
batch size only). A :class:`~jaxlab.infer.pages.PagePool` without prefix caching lends
each request the pages for its prompt and its whole budget up front, so the table never
grows and no request waits. The batch is prefilled at once (ragged, right-padded to one
bucket) and decoded in jitted chunks of up to ``chunk_tokens`` steps; :func:`generate`
uses one chunk of ``max_len`` steps, so it makes exactly two host round trips. Timings
exclude compilation, which is reported on its own (``compile_s``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np

from jaxlab.infer.chunks import Chunk
from jaxlab.infer.engine import Engine
from jaxlab.infer.naive import NaiveEngine
from jaxlab.infer.pages import PagePool, default_num_pages
from jaxlab.infer.request import BadRequest, Request
from jaxlab.infer.speculative.engine import SpeculativeEngine
from jaxlab.infer.speculative.state import SpecUsage
from jaxlab.infer.steps import NO_TOKEN
from jaxlab.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Result:
    """One request's output. ``token_ids`` exclude the stop/EOS token that ended it."""

    token_ids: list[int]
    text: str | None
    prompt_tokens: int
    finish_reason: FinishReason
    speculative: SpecUsage | None = None  # with a SpeculativeEngine

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Generation(Sequence[Result]):
    """The results of one call (a sequence of :class:`Result`) and its timings.

    Times exclude compilation (``compile_s``, the executables this call had to build).
    ``ttft_s``: from the call to the first tokens on the host (batching, prefill);
    ``prefill_s``: the prefill and its result's copy to the host; ``decode_s``: first
    tokens to last tokens on the host.
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

    @property
    def draft_tokens(self) -> int:
        return sum(r.speculative.draft_tokens for r in self.results if r.speculative)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.speculative.accepted_tokens for r in self.results if r.speculative)

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
    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    drafted: int = 0
    accepted: int = 0
    speculating: bool = True


class Stream:
    """Iterates over one batch's new tokens: a ``list[list[int]]`` (one list per request)
    per host round trip, stop tokens never included. After the last item,
    :attr:`generation` holds the :class:`Generation`."""

    def __init__(
        self,
        engine: Engine | SpeculativeEngine,
        requests: Sequence[Request],
        *,
        kv_cache: bool = True,
        chunk_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if not requests:
            raise BadRequest("no requests")
        self.t_call = time.perf_counter()
        self.engine = engine
        self.device: Engine | SpeculativeEngine | NaiveEngine = (
            engine if kv_cache else engine.naive()
        )
        self.requests = list(requests)
        self.kv_cache = kv_cache
        self.chunk_tokens = chunk_tokens or engine.cfg.inference.stream_chunk_tokens
        self.tokenizer = tokenizer
        self.rows = [_Row(r.stop_ids) for r in self.requests]
        self.generation: Generation | None = None
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

    def _count(self, stats: Any) -> None:
        for b, row in enumerate(self.rows):
            row.drafted += int(stats.drafted[b])
            row.accepted += int(stats.accepted[b])
            row.speculating = bool(stats.on[b])

    def _chunks(self) -> tuple[int, list[Chunk]]:
        """The batch's pool size, and each request as one whole-prompt chunk over the pages
        a fresh pool lends it for its prompt and its budget."""
        eng = self.engine
        n = len(self.requests)
        num_pages = default_num_pages(n, eng.max_len, eng.page_size)
        pool = PagePool(num_pages, eng.page_size)
        chunks = []
        for i, r in enumerate(self.requests):
            got = pool.admit(i, r.prompt_ids, reserve=r.sampling.max_new_tokens)
            assert got is not None, "a checked request fits max_len, so its max_pages"
            chunks.append(Chunk(r.prompt_ids, 0, got.pages, r.sampling, adapter=r.adapter))
        return num_pages, chunks

    def _run(self) -> Iterator[list[list[int]]]:
        eng, dev = self.engine, self.device
        compiled_before = eng.compile_seconds
        t0 = time.perf_counter()
        num_pages, chunks = self._chunks()
        state: Any = dev.init_decode_state(len(chunks), num_pages)  # or the baseline's
        state, pre = dev.prefill(state, chunks)
        first, done = jax.device_get((pre.tokens, pre.done))
        t1 = time.perf_counter()
        compile_s = eng.compile_seconds - compiled_before
        prefill_s = t1 - t0 - compile_s
        ttft_s = t1 - self.t_call - compile_s
        yield self._take(np.asarray(first)[None, :], np.asarray(done))

        state = dev.insert(pre, state, list(range(len(chunks))))
        decode_s = 0.0
        while not all(r.done for r in self.rows):
            c0 = eng.compile_seconds
            t2 = time.perf_counter()
            state, out, done, *stats = dev.generate(state, self.chunk_tokens)
            out, done, stats = jax.device_get((out, done, stats))
            for s in stats:  # a speculating engine's per-row counts of the call
                self._count(s)
            dc = eng.compile_seconds - c0
            compile_s += dc
            decode_s += time.perf_counter() - t2 - dc
            yield self._take(np.asarray(out), np.asarray(done))

        results = []
        for row, req in zip(self.rows, self.requests, strict=True):
            stopped = bool(row.tokens) and row.tokens[-1] in row.stops
            toks = row.tokens[:-1] if stopped else list(row.tokens)
            text = self.tokenizer.decode(toks) if self.tokenizer is not None else None
            spec = None
            if isinstance(dev, SpeculativeEngine):
                spec = SpecUsage(dev.method, row.drafted, row.accepted, not row.speculating)
            reason: FinishReason = "stop" if stopped else "length"
            results.append(Result(toks, text, len(req.prompt_ids), reason, spec))
        self.generation = Generation(
            results=results,
            ttft_s=ttft_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            compile_s=compile_s,
            compiles=eng.compiles,
            bucket=pre.bucket,
            kv_cache=self.kv_cache,
            sampled_tokens=sum(len(r.tokens) for r in self.rows),
        )


def stream(
    engine: Engine | SpeculativeEngine,
    requests: Sequence[Request],
    *,
    kv_cache: bool = True,
    chunk_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Stream:
    """A :class:`Stream` over ``requests`` (checked with :meth:`Request.create`)."""
    return Stream(
        engine, requests, kv_cache=kv_cache, chunk_tokens=chunk_tokens, tokenizer=tokenizer
    )


def generate(
    engine: Engine | SpeculativeEngine,
    requests: Sequence[Request],
    *,
    kv_cache: bool = True,
    tokenizer: Tokenizer | None = None,
) -> Generation:
    """Run ``requests`` to completion as one batch; with ``tokenizer`` each result has text."""
    s = Stream(
        engine, requests, kv_cache=kv_cache, chunk_tokens=engine.max_len, tokenizer=tokenizer
    )
    for _ in s:
        pass
    assert s.generation is not None
    return s.generation


__all__ = ["FinishReason", "Generation", "Result", "Stream", "generate", "stream"]
