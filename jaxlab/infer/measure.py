"""Generation throughput, measured honestly: warm-up first, compiles excluded, median of runs.

``measure_generate`` is what benchmark suites call. Each timed sample is one whole
offline :func:`~jaxlab.infer.offline.generate` call (host batching, prefill, the decode
loop, the device->host copy of every token), timed on the wall clock; it returns only
after the tokens are on the host, so nothing is left in flight. Warm-up calls compile every executable first, and the
result says how many compiles happened during the timed calls (it must be 0).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxlab.infer import offline
from jaxlab.infer.engine import Engine
from jaxlab.infer.request import Request
from jaxlab.infer.sampling import SamplingParams


def generation_requests(
    engine: Engine, batch: int, prompt_len: int, new_tokens: int, seed: int = 0
) -> list[Request]:
    """``batch`` random prompts of ``prompt_len`` tokens, each to generate exactly
    ``new_tokens`` greedily (EOS ignored): what :func:`measure_generate` times."""
    rng = np.random.default_rng(seed)
    vocab = engine.cfg.model.vocab_size
    prompts = rng.integers(0, vocab, size=(batch, prompt_len)).tolist()
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [Request.create(p, sp, engine.limits()) for p in prompts]


def measure_generate(
    engine: Engine,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    *,
    kv_cache: bool = True,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    before: Callable[[], Any] | None = None,
    warm_each: int = 0,
) -> dict[str, Any]:
    """Greedy generation of ``new_tokens`` per row for ``batch`` random prompts.

    EOS is ignored so every row generates exactly ``new_tokens``. Returns the median
    ``tokens_per_s`` (``batch * new_tokens`` over the whole call, prefill included, the
    figure Hugging Face's ``generate`` timing gives), ``decode_tokens_per_s`` (tokens after
    the first over the decode time alone), the raw samples and the compile counts.
    ``before``, when given, runs untimed ahead of every call, warm-up calls included (the
    peer suite runs the peer's repetition there, so the two sides' samples alternate), and
    ``warm_each`` untimed calls right before each timed one (after ``before``), so a timed
    call starts with the caches its own previous call left, not the peer's.
    """
    requests = generation_requests(engine, batch, prompt_len, new_tokens, seed)

    for _ in range(max(warmup, 1)):
        if before is not None:
            before()
        offline.generate(engine, requests, kv_cache=kv_cache)
    compiles_before = engine.compiles
    wall: list[float] = []
    prefill: list[float] = []
    decode: list[float] = []
    for _ in range(repeats):
        if before is not None:
            before()
        for _ in range(warm_each):
            offline.generate(engine, requests, kv_cache=kv_cache)
        t0 = time.perf_counter()
        gen = offline.generate(engine, requests, kv_cache=kv_cache)
        wall.append(time.perf_counter() - t0)
        prefill.append(gen.prefill_s)
        decode.append(gen.decode_s)
        if any(r.generated_tokens != new_tokens for r in gen):
            raise RuntimeError("a row generated fewer tokens than asked")
    after = engine.compiles
    med_wall = statistics.median(wall)
    med_decode = statistics.median(decode)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "kv_cache": kv_cache,
        "repeats": repeats,
        "wall_s": wall,
        "median_s": med_wall,
        "tokens_per_s": batch * new_tokens / med_wall,
        "prefill_s": statistics.median(prefill),
        "decode_s": med_decode,
        "decode_tokens_per_s": batch * (new_tokens - 1) / med_decode if med_decode else None,
        "compiles": after,
        "recompiles_while_timed": {k: after[k] - compiles_before[k] for k in after},
        "platform": engine.platform,
        "precision": engine.precision,
    }
