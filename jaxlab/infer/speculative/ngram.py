"""Prompt lookup (vLLM's ``ngram`` proposer): draft the tokens that followed the latest
earlier occurrence of the row's last ``n`` tokens.

It runs on the device, inside the decode loop, because it is cheap there and the host does
not have what it needs: the row's tokens (prompt and generated) live in the decode state
(a token-id page pool beside the KV pages, :mod:`jaxlab.infer.speculative.state`), and the
host learns the generated ones only when a decode call returns, many tokens later. On the
host, every verify pass would need a round trip. On the device, matching is ``n``
compares of the row's ``S`` positions (a few thousand integer ops per row and step), next
to a forward pass of millions of FLOPs.

Matching: the sequence is the row's tokens at positions ``0 .. pos - 1`` and its current
token at ``pos``. For ``n`` from ``ngram_max`` down to ``ngram_min`` it looks for the
latest ``j < pos`` where the ``n`` tokens ending at ``j`` equal the ``n`` ending at
``pos``; the longest ``n`` with a match wins. The draft is the ``k`` tokens after ``j``,
read periodically (position ``j + 1 + (i mod (pos - j))``): the tokens after ``j`` up to
``pos`` repeat, which is what a match this close to the end means, and it keeps every
draft inside the known tokens. No match: no draft (the row decodes plainly this step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

#: Left padding of the sequence: equal to no token id.
NO_TOKEN_ID = -2


def lookup(
    history: Array, token: Array, pos: Array, k: int, n_min: int, n_max: int
) -> tuple[Array, Array]:
    """``(drafts i32[B, k], found bool[B])`` from ``history i32[B, S]`` (row ``b``'s token at
    each position ``< pos[b]``; later entries are ignored) and the current ``token i32[B]``
    at ``pos i32[B]`` (module docstring). Rows without a match get ``found = False`` and
    meaningless drafts."""
    b, s = history.shape
    at = jnp.arange(s)[None, :]
    seq = jnp.where(at == pos[:, None], token[:, None], jnp.where(at < pos[:, None], history, -1))
    padded = jnp.pad(seq, ((0, 0), (n_max - 1, 0)), constant_values=NO_TOKEN_ID)
    best = jnp.full((b,), -1, jnp.int32)
    for n in range(n_min, n_max + 1):  # a longer n overrides a shorter one's match
        # suffix[:, i]: the i-th of the n tokens ending at pos.
        idx = jnp.clip(pos[:, None] - (n - 1) + jnp.arange(n)[None, :], 0, s - 1)
        suffix = jnp.take_along_axis(seq, idx, axis=1)
        match = (at >= n - 1) & (at < pos[:, None]) & (pos[:, None] >= n)
        for i in range(n):
            # The window ending at j holds seq[j - (n - 1) + i] = padded[j + n_max - n + i].
            window = jax.lax.dynamic_slice_in_dim(padded, n_max - n + i, s, axis=1)
            match = match & (window == suffix[:, i : i + 1])
        last = jnp.max(jnp.where(match, at, -1), axis=1).astype(jnp.int32)
        best = jnp.where(last >= 0, last, best)
    found = best >= 0
    period = jnp.maximum(pos - best, 1)
    offsets = jnp.arange(k)[None, :] % period[:, None]
    src = jnp.clip(best[:, None] + 1 + offsets, 0, s - 1)
    return jnp.take_along_axis(seq, src, axis=1).astype(jnp.int32), found


__all__ = ["NO_TOKEN_ID", "lookup"]
