"""AdamW with warmup + cosine/linear decay, global-norm clipping and a decay mask.

Weight decay applies to matmul kernels only: norms' scales, biases (the model has none)
and embedding tables (token and position) are excluded, as is standard for LMs, because
decaying them pulls representations of rare tokens toward zero for no benefit.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxlab.config.schema import TrainConfig

_NO_DECAY_NAMES = ("embed", "pos", "norm", "scale", "bias")


def learning_rate_schedule(train: TrainConfig, total_steps: int | None = None) -> optax.Schedule:
    """Linear warmup to the peak, then cosine/linear decay to ``min_lr_ratio * peak``."""
    peak = train.optimizer.learning_rate
    total = total_steps or train.steps
    warmup = min(train.schedule.warmup_steps, total)
    end = peak * train.schedule.min_lr_ratio
    decay_steps = max(total - warmup, 1)
    kind = train.schedule.kind
    if kind == "constant":
        after = optax.constant_schedule(peak)
    elif kind == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=train.schedule.min_lr_ratio)
    if warmup == 0:
        return after
    # Warm up from peak/warmup (not 0) so step 0 already moves the parameters.
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, after], [warmup])


def decay_mask(params: Any) -> Any:
    """True where weight decay applies: >= 2-D kernels that are not embeddings or norms."""

    def keep(path: tuple[Any, ...], leaf: Any) -> bool:
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path).lower()
        return getattr(leaf, "ndim", 0) >= 2 and not any(n in names for n in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(
    train: TrainConfig, total_steps: int | None = None
) -> optax.GradientTransformation:
    opt = train.optimizer
    parts: list[optax.GradientTransformation] = []
    if opt.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(opt.clip_norm))
    parts.append(
        optax.adamw(
            learning_rate=learning_rate_schedule(train, total_steps),
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
