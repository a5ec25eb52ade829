"""Activation checkpointing (``train.remat``): which of a block's activations the backward
pass keeps, and which it recomputes.

Each policy wraps a block (the unrolled blocks one by one, or the body of the layer scan)
in ``jax.checkpoint`` with a ``jax.checkpoint_policies`` policy. Recomputing changes no
result: a policy only chooses what is stored between the forward and the backward pass,
and a test checks every policy's loss and gradients against the plain model.

==========================  ===============================================================
``none``                    no checkpointing: every residual the backward pass needs is kept
``full``                    only each block's input; the whole block runs again backward
``save_dots``               every matmul output, attention's ``QK^T`` and ``PV`` included
                            (``dots_saveable``; at long sequences those are large)
``save_dots_no_batch``      the weight matmuls' outputs, not attention's batched dots
                            (``dots_with_no_batch_dims_saveable``; MaxText's "minimal")
``save_qkv_proj``           the fused QKV projection only (named ``qkv_proj``)
``save_qkv_out_proj``       it and attention's output projection (``out_proj``)
==========================  ===============================================================

The names are set with ``jax.ad_checkpoint.checkpoint_name`` in
:mod:`jaxlab.model.attention`; outside ``jax.checkpoint`` they are no-ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

#: Every ``train.remat`` value (``jaxlab.config.schema.RematPolicy``).
POLICIES = (
    "none",
    "full",
    "save_dots",
    "save_dots_no_batch",
    "save_qkv_proj",
    "save_qkv_out_proj",
)


def normalize(remat: bool | str) -> str:
    """A policy name; ``True``/``False`` (the older boolean) are ``full``/``none``."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; expected one of {', '.join(POLICIES)}")
    return remat


def checkpoint_policy(name: str) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy of a name (None: the default, which saves nothing)."""
    cp = jax.checkpoint_policies
    return {
        "full": None,
        "save_dots": cp.dots_saveable,
        "save_dots_no_batch": cp.dots_with_no_batch_dims_saveable,
        "save_qkv_proj": cp.save_only_these_names("qkv_proj"),
        "save_qkv_out_proj": cp.save_only_these_names("qkv_proj", "out_proj"),
    }[name]


@functools.cache
def wrap(
    fn: Callable[..., Any],
    name: str,
    *,
    static_argnums: tuple[int, ...] = (),
    prevent_cse: bool = True,
) -> Callable[..., Any]:
    """``fn`` under policy ``name`` (``fn`` itself for ``none``); made once per arguments.

    ``prevent_cse=False`` inside ``lax.scan``, where XLA cannot merge the recomputation
    with the forward pass anyway (the ``jax.checkpoint`` documentation's advice).
    """
    if name == "none":
        return fn
    return jax.checkpoint(
        fn, policy=checkpoint_policy(name), static_argnums=static_argnums, prevent_cse=prevent_cse
    )


__all__ = ["POLICIES", "checkpoint_policy", "normalize", "wrap"]
