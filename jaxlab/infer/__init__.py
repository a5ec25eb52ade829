"""jaxlab.infer: KV-cached inference behind a device API, and offline generation on top of it.

=================  ===================================================================
``engine``         :class:`Engine`: ``init_decode_state`` / ``set_table`` / ``prefill`` /
                   ``insert`` / ``generate`` over a paged cache, compiled once per shape
                   and counted
``chunks``         :class:`Chunk`: a run of one prompt's positions; a prefill's batching
``steps``          the pure functions it jits: prefill, the decode step and loop, insert
``state``          :class:`DecodeState`: the paged cache and per-row bookkeeping
``pages``          :class:`PagePool`: the paged cache's pages per sequence, prefix caching
``sampling``       per-request sampling as per-row arrays; ``sample``
``request``        :class:`Request`: the one request type, checked once
``offline``        :func:`generate` / :func:`stream` over the engine's verbs
``naive``          :class:`NaiveEngine`: the cache-free baseline behind the same verbs
``load``           :func:`load_run`: params, config and tokenizer of a checkpoint
``measure``        :func:`measure_generate`, the benchmark suites' timing
=================  ===================================================================

See ``docs/inference.md``. This package imports jax; the CLI imports it only inside
command bodies.
"""

from jaxlab.infer.chunks import Chunk
from jaxlab.infer.engine import Engine, Prefill, default_buckets
from jaxlab.infer.load import LoadedRun, load_run
from jaxlab.infer.measure import measure_generate
from jaxlab.infer.naive import NaiveEngine, NaiveState, naive_step
from jaxlab.infer.offline import Generation, Result, Stream, generate, stream
from jaxlab.infer.pages import Admission, PagePool
from jaxlab.infer.request import BadRequest, Limits, Request, RequestError, RequestTooLong
from jaxlab.infer.sampling import (
    MAX_STOP_TOKENS,
    SamplingArrays,
    SamplingParams,
    sample,
    sampling_arrays,
    top_k_top_p_mask,
)
from jaxlab.infer.state import DecodeState
from jaxlab.infer.steps import NO_TOKEN, Weights, decode_step

__all__ = [
    "MAX_STOP_TOKENS",
    "NO_TOKEN",
    "Admission",
    "BadRequest",
    "Chunk",
    "DecodeState",
    "Engine",
    "Generation",
    "Limits",
    "LoadedRun",
    "NaiveEngine",
    "NaiveState",
    "PagePool",
    "Prefill",
    "Request",
    "RequestError",
    "RequestTooLong",
    "Result",
    "SamplingArrays",
    "SamplingParams",
    "Stream",
    "Weights",
    "decode_step",
    "default_buckets",
    "generate",
    "load_run",
    "measure_generate",
    "naive_step",
    "sample",
    "sampling_arrays",
    "stream",
    "top_k_top_p_mask",
]
