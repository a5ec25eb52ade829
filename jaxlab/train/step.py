"""The train step: a pure function, state in, state out, buffers donated.

``TrainState`` is a plain dict pytree so Orbax saves and restores it without adapters::

    params      nnx.State of the parameters the model reads (train.precision.param_dtype)
    master      with train.precision.master_dtype only: the master weights, which the
                optimizer updates; ``params`` are rounded from them after every update
    opt_state   optax state (AdamW moments, schedule count), of the master weights if any
    step        int32 scalar: optimizer updates done so far
    rng         the root PRNG key (uint32[2]); dropout uses fold_in(rng, step)
    skipped     int32 scalar: updates dropped by the non-finite guard ('skip' policy)
    bad_step    int32 scalar: first step whose loss or grad norm was non-finite, -1 if none

A LoRA run (``train.lora``, :class:`LoraSpec`) keeps the same keys, but ``params`` are the
adapter's weights (:data:`jaxlab.model.lora.Weights`) and the optimizer state is theirs
alone: the base parameters are a separate, frozen argument of the step (never donated,
never differentiated, never in ``opt_state``), so the state is what a LoRA checkpoint holds.

Gradient accumulation runs as a ``lax.scan`` over micro-batches inside the one jitted
step. Each micro-batch contributes the gradient of its *summed* token loss, and the sum
is divided by the global number of real tokens once, so k micro-batches give the same
update as one step on the k-times batch (up to f32 summation order).

Master weights (``precision.master_dtype``): the loss is differentiated with respect to
the narrow ``params`` the model reads; each micro-batch's gradient is widened to the master
dtype before it is accumulated, clipped and applied to ``master``, and ``params`` are
``master`` rounded. Without them the optimizer updates ``params`` directly.

The non-finite guard costs no extra host sync: the step itself keeps the old state when
the loss or gradient norm is not finite and records ``bad_step``; the loop reads it with
the metrics it already fetches, and before every checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlab.config.schema import ModelConfig, PrecisionConfig
from jaxlab.model import make_model, split_model
from jaxlab.model.lora import Lora
from jaxlab.model.loss import DEFAULT_CHUNK, head_cross_entropy

Array = jax.Array
TrainState = dict[str, Any]
Batch = dict[str, Array]

#: Folded into a step's dropout key for the adapters' dropout (the model's keeps the key).
LORA_DROPOUT_STREAM = 0x10A


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA step needs besides the adapter weights: their scale (``alpha / rank``)
    and the dropout rate on their input."""

    scale: float
    dropout: float = 0.0

    def adapters(self, weights: Any, key: Array | None) -> Lora:
        """The training adapter (one, for every row), its dropout keyed by ``key``."""
        k = None if key is None else jax.random.fold_in(key, LORA_DROPOUT_STREAM)
        return Lora.single(weights, self.scale, dropout_key=k, dropout_rate=self.dropout)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Every floating-point leaf of ``tree`` in ``dtype``."""
    return jax.tree.map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


def initial_params(
    model_cfg: ModelConfig, precision: PrecisionConfig, seed: int, *, remat: bool | str = False
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graphdef and its initial parameters: in ``precision.master_dtype`` when
    master weights are on (what :func:`init_state` keeps as ``master``, rounding the
    model's ``params`` from it), else in ``param_dtype``.

    Either way the values are the same draw (the initialiser draws in float32 first), so a
    run with master weights starts from the master copy of the run without them."""
    if precision.master_dtype is None:
        return split_model(make_model(model_cfg, precision, seed, remat=remat))
    wide = precision.model_copy(
        update={"param_dtype": precision.master_dtype, "master_dtype": None}
    )
    graphdef, _ = split_model(
        nnx.eval_shape(lambda: make_model(model_cfg, precision, seed, remat=remat))
    )
    return graphdef, split_model(make_model(model_cfg, wide, seed, remat=remat))[1]


def init_state(
    params: Any,
    tx: optax.GradientTransformation,
    seed: int,
    *,
    param_dtype: Any = None,
) -> TrainState:
    """The initial train state. With ``param_dtype`` (master weights on), ``params`` are the
    master copy: kept as ``master``, the optimizer's, and rounded to ``param_dtype`` as the
    ``params`` the model reads."""
    state = {
        "params": params if param_dtype is None else cast_tree(params, param_dtype),
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "rng": jax.random.PRNGKey(seed),
        "skipped": jnp.zeros((), jnp.int32),
        "bad_step": jnp.full((), -1, jnp.int32),
    }
    if param_dtype is not None:
        state["master"] = params
    return state


def token_losses(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    batch: Batch,
    dropout_key: Array | None,
    lora: Lora | None = None,
    *,
    loss_chunk_tokens: int = DEFAULT_CHUNK,
) -> tuple[Array, Array, Array]:
    """(summed masked cross-entropy, real-token count, correct predictions), all f32.

    Per token the loss is ``logsumexp(logits) - logits[target]`` (the same value as
    ``-log_softmax[target]``), weighted by ``loss_mask``; ``correct`` counts
    ``argmax(logits) == target`` the same way. The LM head and the cross-entropy run fused
    and chunked (:func:`jaxlab.model.loss.head_cross_entropy`): the ``[B, T, vocab]``
    logits and their gradient are never materialised, which on a memory-bound CPU is
    most of the head's cost (``docs/performance.md``). ``lora``: adapters on the model;
    ``loss_chunk_tokens``: tokens per logits block (``train.loss_chunk_tokens``).
    """
    model = nnx.merge(graphdef, params)
    h = model.features(
        batch["tokens"],
        batch["positions"],
        segment_ids=batch["segment_ids"],
        dropout_key=dropout_key,
        lora=lora,
    )
    kernel, vocab_major = model.head_kernel()
    mask = batch["loss_mask"].astype(jnp.float32)
    total, correct = head_cross_entropy(
        h,
        kernel,
        batch["targets"],
        mask,
        vocab_major=vocab_major,
        compute_dtype=model.compute_dtype,
        chunk=loss_chunk_tokens,
    )
    return total, jnp.sum(mask), correct


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    grad_accum_steps: int,
    dropout: bool,
    lora: LoraSpec | None = None,
    loss_chunk_tokens: int = DEFAULT_CHUNK,
) -> Callable[..., tuple[TrainState, dict[str, Array]]]:
    """Build the pure step function (jit it with ``donate_argnums=0``).

    ``step_fn(state, batch)``; with ``lora``, ``step_fn(state, batch, base)``: ``state``'s
    params are the adapter, ``base`` the frozen model parameters.
    """
    lora_dropout = lora is not None and lora.dropout > 0

    def sum_loss(params: Any, batch: Batch, key: Array | None, base: Any):
        if lora is None:
            weights, model_key, adapters = params, key, None
        else:
            weights, model_key = base, key if dropout else None
            adapters = lora.adapters(params, key if lora_dropout else None)
        total, n, correct = token_losses(
            graphdef, weights, batch, model_key, adapters, loss_chunk_tokens=loss_chunk_tokens
        )
        return total, (n, correct)

    grad_fn = jax.value_and_grad(sum_loss, has_aux=True)

    def step_fn(
        state: TrainState, batch: Batch, base: Any = None
    ) -> tuple[TrainState, dict[str, Array]]:
        params = state["params"]
        # The optimizer's weights: the master copy if there is one.
        master = state.get("master", params)
        step = state["step"]
        key = jax.random.fold_in(state["rng"], step) if dropout or lora_dropout else None

        def widen(g: Any) -> Any:  # a gradient in the master weights' dtypes
            return (
                g if master is params else jax.tree.map(lambda a, m: a.astype(m.dtype), g, master)
            )

        if grad_accum_steps == 1:
            (total, (n, correct)), grads = grad_fn(params, batch, key, base)
            grads = widen(grads)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(grad_accum_steps, x.shape[0] // grad_accum_steps, *x.shape[1:]),
                batch,
            )

            def body(carry, xs):
                g_acc, l_acc, n_acc, c_acc = carry
                i, mb = xs
                k = None if key is None else jax.random.fold_in(key, i)
                (total, (n, correct)), g = grad_fn(params, mb, k, base)
                g_acc = jax.tree.map(jnp.add, g_acc, widen(g))
                return (g_acc, l_acc + total, n_acc + n, c_acc + correct), None

            zeros = jax.tree.map(jnp.zeros_like, master)
            init = (zeros, jnp.zeros(()), jnp.zeros(()), jnp.zeros(()))
            (grads, total, n, correct), _ = jax.lax.scan(
                body, init, (jnp.arange(grad_accum_steps), micro)
            )

        denom = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = total / denom
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = tx.update(grads, state["opt_state"], master)
        new_master = optax.apply_updates(master, updates)
        new_params = (
            new_master
            if master is params
            else jax.tree.map(lambda m, p: m.astype(p.dtype), new_master, params)
        )

        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # Either policy keeps the last good state: 'abort' stops the loop at its next
        # metrics fetch (and never checkpoints a bad state); 'skip' just moves on.
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_state: TrainState = {
            "params": keep(new_params, params),
            "opt_state": keep(new_opt_state, state["opt_state"]),
            "step": step + 1,
            "rng": state["rng"],
            "skipped": state["skipped"] + (~finite).astype(jnp.int32),
            "bad_step": jnp.where((state["bad_step"] < 0) & ~finite, step + 1, state["bad_step"]),
        }
        if master is not params:
            new_state["master"] = keep(new_master, master)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": jnp.asarray(schedule(step), jnp.float32),
            "tokens": n,
            "accuracy": correct / denom,
            "finite": finite,
        }
        return new_state, metrics

    return step_fn


def make_eval_step(
    graphdef: nnx.GraphDef,
    lora: LoraSpec | None = None,
    *,
    loss_chunk_tokens: int = DEFAULT_CHUNK,
) -> Callable[..., dict[str, Array]]:
    """``eval_fn(params, batch)``; with ``lora``, ``eval_fn(adapter, batch, base)``.
    ``loss_chunk_tokens``: the train step's head blocks (the same losses at any size)."""

    def eval_fn(params: Any, batch: Batch, base: Any = None) -> dict[str, Array]:
        if lora is None:
            weights, adapters = params, None
        else:
            weights, adapters = base, lora.adapters(params, None)
        total, n, correct = token_losses(
            graphdef, weights, batch, None, adapters, loss_chunk_tokens=loss_chunk_tokens
        )
        return {"loss_sum": total, "tokens": n, "correct": correct}

    return eval_fn


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a pytree: the restore target for Orbax."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
        tree,
    )
