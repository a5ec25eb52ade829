"""jaxlab.infer: the inference engine (KV-cached prefill/decode, sampling, streaming).

See ``docs/inference.md`` for the design: cache layout, prefill buckets, ragged masking, the
in-jit decode loop, chunked streaming, sampling keys and compile accounting.

This package imports jax; the CLI imports it only inside command bodies.
"""

from jaxlab.infer.core import NO_TOKEN, Weights, naive_step, weights_for
from jaxlab.infer.engine import (
    BadRequest,
    Engine,
    Generation,
    Request,
    RequestTooLong,
    Result,
    Stream,
    Utf8Stream,
    default_buckets,
)
from jaxlab.infer.fused import decode_step
from jaxlab.infer.measure import measure_generate
from jaxlab.infer.sampling import (
    MAX_STOP_TOKENS,
    SamplingArrays,
    SamplingParams,
    sample,
    sampling_arrays,
    top_k_top_p_mask,
)
from jaxlab.infer.state import DecodeState, NaiveState, Prefix

__all__ = [
    "MAX_STOP_TOKENS",
    "NO_TOKEN",
    "BadRequest",
    "DecodeState",
    "Engine",
    "Generation",
    "NaiveState",
    "Prefix",
    "Request",
    "RequestTooLong",
    "Result",
    "SamplingArrays",
    "SamplingParams",
    "Stream",
    "Utf8Stream",
    "Weights",
    "decode_step",
    "default_buckets",
    "measure_generate",
    "naive_step",
    "sample",
    "sampling_arrays",
    "top_k_top_p_mask",
    "weights_for",
]
