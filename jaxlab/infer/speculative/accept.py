"""The acceptance rule of speculative decoding: which drafted tokens a row keeps, and the
token it takes where it stops (rejection sampling, Leviathan et al. 2023, Chen et al. 2023).

A verify pass gives the model's logits at ``T = k + 1`` positions of a row: position ``i``
predicts the token after the row's current token and drafts ``d_1 .. d_i``. With ``p_i``
the row's sampling distribution there (temperature, top-k, top-p:
:func:`~jaxlab.infer.sampling.filtered`) and ``q_i`` the proposer's (a point mass at
``d_{i+1}`` for prompt lookup), draft ``d_{i+1}`` is accepted with probability
``min(1, p_i(d) / q_i(d))``, in order, until the first rejection at ``j``; there the row
draws from the residual ``max(0, p_j - q_j)`` renormalised. If every draft is accepted it
draws a bonus token from ``p_k``. Each emitted token then follows ``p`` exactly: for a
draft position, ``P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y)))
r(x) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x)``.

Greedy rows (temperature 0) have a point mass at the argmax for ``p``: a draft is kept iff
it is the argmax, and the row takes the argmax where it stops, so the tokens are plain
greedy decoding's.

Randomness is per token index, like plain sampling (:mod:`jaxlab.infer.sampling`): the
token at index ``t`` uses ``key_t = fold_in(PRNGKey(seed), t)``; its draw (residual, bonus,
or a row without drafts) uses ``uniform(key_t)``, the very number plain sampling uses, and
the acceptance test of the draft at index ``t`` uses ``uniform(fold_in(key_t, 1))``. A row
without drafts therefore draws exactly the token plain decoding draws.

This module is pure ``jnp``: no model, no cache. :func:`accept` is what the verify pass
calls and what the tests check against the target distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlab.infer.sampling import SamplingArrays, argmax, filtered, inverse_cdf, row_keys

Array = jax.Array

#: ``fold_in`` tags of the per-index key: acceptance tests, and a draft model's own draws.
ACCEPT_STREAM = 1
DRAFT_STREAM = 2


def per_position(sp: SamplingArrays, t: int) -> SamplingArrays:
    """``sp`` with each row repeated ``t`` times (rows of ``[B * t, ...]``)."""
    return jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), sp)


def index_keys(seed: Array, t: Array, n: int) -> Array:
    """``uint32[B, n, 2]``: the keys of token indices ``t[b] .. t[b] + n - 1`` of each row."""
    idx = t[:, None] + jnp.arange(n, dtype=t.dtype)[None, :]
    keys = row_keys(jnp.repeat(seed, n), idx.reshape(-1))
    return keys.reshape(seed.shape[0], n, 2)


def stream_uniforms(keys: Array, stream: int | None) -> Array:
    """``f32[...]`` uniforms of ``keys [..., 2]`` (``fold_in(key, stream)`` first, if given)."""
    flat = keys.reshape(-1, 2)
    if stream is not None:
        flat = jax.vmap(lambda k: jax.random.fold_in(k, stream))(flat)
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(flat)
    return u.reshape(keys.shape[:-1])


def leading(ok: Array) -> Array:
    """``i32[B]``: how many leading entries of each row of ``ok [B, n]`` are true."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def emitted(drafts: Array, n: Array, last: Array) -> Array:
    """``i32[B, k + 1]``: each row's accepted drafts ``drafts[:, :n]``, then ``last``
    (repeated to the end: entries past ``n`` are never read)."""
    b, k = drafts.shape
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    i = jnp.arange(k + 1)[None, :]
    return jnp.where(i < n[:, None], padded, last[:, None]).astype(jnp.int32)


def accept(
    logits: Array,
    drafts: Array,
    draft_probs: Array | None,
    has_drafts: Array,
    sp: SamplingArrays,
    t: Array,
) -> tuple[Array, Array]:
    """Verify each row's drafts: ``(tokens i32[B, k + 1], accepted i32[B])``.

    Args:
      logits: ``f32[B, k + 1, V]``, the model's logits at the row's current token and its
        ``k`` drafts.
      drafts: ``i32[B, k]``, the drafted tokens.
      draft_probs: ``f32[B, k, V]``, the distribution each draft was drawn from; None: a
        point mass at the draft (a deterministic proposer such as prompt lookup).
      has_drafts: ``bool[B]``; a row without drafts accepts none and draws its token from
        ``p_0`` exactly as plain sampling does.
      sp: the rows' sampling parameters; ``t``: ``i32[B]``, the index of the row's next
        token (its ``generated`` count).

    ``tokens[b, :accepted[b]]`` are the kept drafts and ``tokens[b, accepted[b]]`` the
    token drawn where the row stopped (module docstring); later entries are filler.
    """
    b, n, v = logits.shape
    k = n - 1
    logits = logits.astype(jnp.float32)
    greedy = argmax(logits.reshape(b * n, v)).reshape(b, n)

    def at(x: Array, j: Array) -> Array:
        return jnp.take_along_axis(x, j[:, None], axis=1)[:, 0]

    def greedy_rows() -> tuple[Array, Array]:
        nacc = leading((drafts == greedy[:, :k]) & has_drafts[:, None])
        return emitted(drafts, nacc, at(greedy, nacc)), nacc

    def sampled_rows() -> tuple[Array, Array]:
        masked = filtered(logits.reshape(b * n, v), per_position(sp, n)).reshape(b, n, v)
        logp = jax.nn.log_softmax(masked, axis=-1)
        keys = index_keys(sp.seed, t, n)
        u_draw = stream_uniforms(keys, None)  # [B, n]: plain sampling's uniform
        u_accept = stream_uniforms(keys[:, :k], ACCEPT_STREAM)  # [B, k]
        p_d = jnp.exp(jnp.take_along_axis(logp[:, :k], drafts[:, :, None], axis=2)[..., 0])
        if draft_probs is None:
            q_d = jnp.ones_like(p_d)
        else:
            q_d = jnp.take_along_axis(draft_probs, drafts[:, :, None], axis=2)[..., 0]
        keep = jnp.where(
            (sp.temperature > 0)[:, None], u_accept * q_d < p_d, drafts == greedy[:, :k]
        )
        nacc = leading(keep & has_drafts[:, None])
        # Where the row stopped: p_j, or the residual after a rejected draft.
        p_j = jnp.take_along_axis(masked, nacc[:, None, None], axis=1)[:, 0]  # [B, V]
        j_draft = jnp.minimum(nacc, k - 1) if k else nacc
        if draft_probs is None:
            d_j = at(drafts, j_draft) if k else jnp.zeros((b,), jnp.int32)
            residual = jnp.where(jnp.arange(v)[None, :] == d_j[:, None], -jnp.inf, p_j)
        else:
            q_j = jnp.take_along_axis(draft_probs, j_draft[:, None, None], axis=1)[:, 0]
            r = jnp.maximum(jax.nn.softmax(p_j, axis=-1) - q_j, 0.0)
            residual = jnp.where(r > 0, jnp.log(jnp.where(r > 0, r, 1.0)), -jnp.inf)
        rejected = has_drafts & (nacc < k)
        # A residual without mass only follows a rejection of probability ~0 (rounding):
        # draw from p_j then.
        usable = jnp.any(residual > -jnp.inf, axis=-1)
        drawn = inverse_cdf(
            jnp.where((rejected & usable)[:, None], residual, p_j), at(u_draw, nacc)
        )
        last = jnp.where(sp.temperature > 0, drawn, at(greedy, nacc))
        return emitted(drafts, nacc, last), nacc

    return jax.lax.cond(jnp.all(sp.temperature <= 0), greedy_rows, sampled_rows)


__all__ = [
    "ACCEPT_STREAM",
    "DRAFT_STREAM",
    "accept",
    "emitted",
    "index_keys",
    "leading",
    "per_position",
    "stream_uniforms",
]
