"""What int8 weights cost in quality: the eval split scored by a run's float weights and by
their int8 form (``inference.weights = "int8"``) in one pass, as ``jaxlab eval --weights
int8`` reports it.

Per real eval token (padding excluded, as in :func:`~jaxlab.train.step.token_losses`), the
int8 model's cross-entropy and accuracy, and whether its greedy (argmax) next token equals
the float model's: **greedy agreement** is the share of tokens where they are the same,
both models reading the same (teacher-forced) text. Free-running generation diverges from
the first disagreement on, so its agreement depends on the prompts and the length; this
one depends on the model and the data only.

The int8 weights are made here exactly as the inference engine makes them
(:mod:`jaxlab.model.quant`), and the int8 forward is the model's own code with
:class:`~jaxlab.model.quant.QuantizedKernel`\\ s in place of the float kernels. The logits
are formed a sequence chunk at a time, never ``[B, T, vocab]`` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlab.data import eval_batches
from jaxlab.kernels.reduce import first_index_of, reduce_last
from jaxlab.model.quant import Activations, QuantizedKernel, quantize_dense, quantize_tied_head
from jaxlab.parallel import place_batch

Array = jax.Array
Batch = Mapping[str, Array]
#: The int8 side: quantized params, and the quantized tied head (None: untied, in params).
Int8Weights = tuple[nnx.State, QuantizedKernel | None]

#: Sequence positions per logits chunk: ``[B, 32, V]`` float32 at a time per model.
SEQ_CHUNK = 32


def int8_weights(
    graphdef: nnx.GraphDef, params: nnx.State, activations: Activations
) -> Int8Weights:
    """``params``' int8 form, as the inference engine reads it: dense kernels quantized per
    output channel, and a tied head as an int8 ``[d_model, vocab]`` copy."""
    qparams = quantize_dense(params, activations)
    kernel, vocab_major = nnx.merge(graphdef, qparams).head_kernel()
    return qparams, quantize_tied_head(kernel, activations) if vocab_major else None


def _chunk_of(seq_len: int) -> int:
    """The largest divisor of ``seq_len`` up to :data:`SEQ_CHUNK`."""
    return max(c for c in range(1, min(SEQ_CHUNK, seq_len) + 1) if seq_len % c == 0)


def make_int8_eval_step(
    graphdef: nnx.GraphDef,
) -> Callable[[nnx.State, Int8Weights, Batch], dict[str, Array]]:
    """``step(params, int8_weights, batch) -> sums``: the int8 model's ``loss_sum`` and
    ``correct``, ``agree`` (its argmax equals the float model's) and ``tokens``, each a sum
    over the batch's real tokens."""

    def step(params: nnx.State, weights: Int8Weights, batch: Batch) -> dict[str, Array]:
        qparams, qhead = weights
        model_f, model_q = nnx.merge(graphdef, params), nnx.merge(graphdef, qparams)
        kwargs = {"segment_ids": batch["segment_ids"]}
        hf = model_f.features(batch["tokens"], batch["positions"], **kwargs)
        hq = model_q.features(batch["tokens"], batch["positions"], **kwargs)
        b, t = hf.shape[:2]
        c = _chunk_of(t)

        def by_chunk(x: Array) -> Array:  # [B, T, ...] -> [T / c, B, c, ...]
            return x.reshape(b, t // c, c, *x.shape[2:]).swapaxes(0, 1)

        def chunk(xs: tuple[Array, Array, Array, Array]) -> tuple[Array, Array, Array, Array]:
            hf_c, hq_c, target, mask = xs
            lf = model_f.logits(hf_c)
            lq = model_q.logits(hq_c, qhead)
            mq = reduce_last(lq, "max")
            lse = mq + jnp.log(reduce_last(jnp.exp(lq - mq[..., None]), "sum"))
            ce = lse - jnp.take_along_axis(lq, target[..., None], axis=-1)[..., 0]
            greedy_q = first_index_of(lq, mq)
            greedy_f = first_index_of(lf, reduce_last(lf, "max"))
            return (
                jnp.sum(ce * mask),
                jnp.sum((greedy_q == target) * mask),
                jnp.sum((greedy_q == greedy_f) * mask),
                jnp.sum(mask),
            )

        mask = batch["loss_mask"].astype(jnp.float32)
        sums = jax.lax.map(
            chunk, (by_chunk(hf), by_chunk(hq), by_chunk(batch["targets"]), by_chunk(mask))
        )
        loss_sum, correct, agree, tokens = (jnp.sum(s) for s in sums)
        return {"loss_sum": loss_sum, "correct": correct, "agree": agree, "tokens": tokens}

    return step


def evaluate_int8(
    step: Callable[[nnx.State, Int8Weights, Batch], Any],
    params: nnx.State,
    weights: Int8Weights,
    store: Any,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    *,
    mesh: Any = None,
) -> dict[str, float]:
    """The int8 side of the eval split (the batches :func:`~jaxlab.train.trainer.
    evaluate_params` reads): ``loss``, ``perplexity``, ``accuracy``, ``greedy_agreement``
    and ``tokens``."""
    sums = {"loss_sum": 0.0, "correct": 0.0, "agree": 0.0, "tokens": 0.0}
    share = (jax.process_index(), jax.process_count())
    for b in eval_batches(
        store, seq_len, batch_size, max_batches, process_index=share[0], process_count=share[1]
    ):
        placed = (
            place_batch(b, mesh) if mesh is not None else {k: jnp.asarray(v) for k, v in b.items()}
        )
        out = jax.device_get(step(params, weights, placed))
        for k in sums:
            sums[k] += float(out[k])
    n = sums["tokens"]
    if n == 0:
        nan = float("nan")
        return {
            "loss": nan,
            "perplexity": nan,
            "accuracy": nan,
            "greedy_agreement": nan,
            "tokens": 0.0,
        }
    loss = sums["loss_sum"] / n
    return {
        "loss": loss,
        "perplexity": float(np.exp(min(loss, 50.0))),
        "accuracy": sums["correct"] / n,
        "greedy_agreement": sums["agree"] / n,
        "tokens": n,
    }


__all__ = ["SEQ_CHUNK", "Int8Weights", "evaluate_int8", "int8_weights", "make_int8_eval_step"]
