"""Per-request sampling: parameters, their per-row array form, the top-k/top-p mask, ``sample``.

Every sampling parameter is a per-row array (:class:`SamplingArrays`), so one compiled
decode step serves a batch that mixes greedy and sampled requests with different
temperatures, top-k, top-p, seeds, stop tokens and budgets.

Keys: the ``t``-th sampled token of a row (``t = 0`` is the token prefill produces) uses
``fold_in(PRNGKey(seed), t)``. The key depends only on the request's own seed and token
index, never on the batch it shares or its slot, so a request's output is the same alone
and inside any batch.

Order of operations for a sampled row: ``logits / temperature`` -> top-k -> top-p (on the
top-k-renormalised distribution, as Hugging Face does) -> an inverse-CDF draw: with
``u = uniform(key)`` (one f32 in ``[0, 1)``), the token is the first index, in vocabulary
order, whose cumulative probability exceeds ``u`` (:func:`inverse_cdf`). That is an exact
draw from the same categorical distribution as Gumbel-max, but it needs one random number
per row instead of one per vocabulary entry (several times cheaper, docs/performance.md).
Rows with ``temperature == 0`` take ``argmax`` of the raw logits. When every row is greedy
a ``lax.cond`` skips the filters and the random draws entirely; when no row filters, a
second one skips the top-k/top-p mask (a sort-free radix select, see
:func:`top_k_top_p_mask`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxlab.config.ranges import INT32_MAX, SAMPLING_RANGES, shown
from jaxlab.config.schema import InferenceConfig
from jaxlab.kernels.reduce import argmax_last, reduce_last

Array = jax.Array

#: Stop-token columns per row (fixed so the decode signature never changes). The EOS id
#: takes one column unless ``ignore_eos``.
MAX_STOP_TOKENS = 8
#: Seeds must fit a non-negative int32 so that the in-jit ``PRNGKey(seed)`` equals the
#: host's ``jax.random.PRNGKey(seed)``.
MAX_SEED = INT32_MAX


class SamplingRow(NamedTuple):
    """One request's sampling values in the dtypes of :class:`SamplingArrays` (host numpy)."""

    temperature: np.float32
    top_k: np.int32
    top_p: np.float32
    seed: np.int32
    stop: np.ndarray  # i32[MAX_STOP_TOKENS], -1 = unused column
    max_new: np.int32


def _int32(name: str, value: int) -> np.int32:
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} = {shown(value)} does not fit int32")
    return np.int32(value)


def _float32(name: str, value: float) -> np.float32:
    try:
        return np.float32(value)
    except OverflowError:  # an int past float64's range
        raise ValueError(f"{name} = {shown(value)} does not fit float32") from None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` is greedy (top-k/top-p ignored).

    The valid range of each value is :data:`jaxlab.config.ranges.SAMPLING_RANGES`
    (:meth:`problem`)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @classmethod
    def from_config(cls, cfg: InferenceConfig, **overrides: object) -> SamplingParams:
        """Defaults from ``inference.*``; ``None`` overrides are ignored."""
        base: dict[str, object] = {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)  # type: ignore[arg-type]

    def with_eos(self, eos_id: int | None) -> SamplingParams:
        """These parameters with ``eos_id`` among the stop tokens (unless ``ignore_eos``):
        the one place a request's full stop set is made."""
        if eos_id is None or self.ignore_eos or eos_id in self.stop_token_ids:
            return self
        return dataclasses.replace(self, stop_token_ids=(*self.stop_token_ids, eos_id))

    def problem(self) -> tuple[str, str] | None:
        """``(field, message)`` for the first invalid field, or None when all are valid.

        The message names the field, its valid range and the value. Every value in range
        is exact in its device dtype, so a checked request's :attr:`row` never raises."""
        for name, valid in SAMPLING_RANGES.items():
            bad = valid.problem(name, getattr(self, name))
            if bad is not None:
                return name, bad
        n = len(self.stop_token_ids)
        if n > MAX_STOP_TOKENS - 1:
            return "stop_token_ids", f"at most {MAX_STOP_TOKENS - 1} stop token ids (got {n})"
        return None

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        bad = self.problem()
        if bad is not None:
            raise ValueError(bad[1])

    @functools.cached_property
    def row(self) -> SamplingRow:
        """These values in the device's dtypes: the host-side half of a prefill, made once per
        request, so that a value no dtype can hold fails its own request, never its batch.
        Raises ``ValueError`` naming the field (not for a checked request: :meth:`problem`)."""
        if len(self.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop token ids per row")
        stop = np.full((MAX_STOP_TOKENS,), -1, np.int32)
        stop[: len(self.stop_token_ids)] = [
            _int32("stop_token_ids", t) for t in self.stop_token_ids
        ]
        return SamplingRow(
            temperature=_float32("temperature", self.temperature),
            top_k=_int32("top_k", self.top_k),
            top_p=_float32("top_p", self.top_p),
            seed=_int32("seed", self.seed),
            stop=stop,
            max_new=_int32("max_new_tokens", self.max_new_tokens),
        )


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters, each with leading axis ``B``."""

    temperature: Array  # f32[B]
    top_k: Array  # i32[B], 0 = off
    top_p: Array  # f32[B], 1 = off
    seed: Array  # i32[B]
    stop: Array  # i32[B, MAX_STOP_TOKENS], -1 = unused column
    max_new: Array  # i32[B], budget of sampled tokens (prefill's token included)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


def sampling_arrays(params: Sequence[SamplingParams]) -> SamplingArrays:
    """The per-row arrays for ``params``, on device, from each one's :attr:`~SamplingParams.row`.

    ``stop_token_ids`` are taken as they are: a request's EOS is already among them
    (:meth:`SamplingParams.with_eos`).
    """
    rows = [p.row for p in params]
    return SamplingArrays(
        temperature=jax.device_put(np.array([r.temperature for r in rows], np.float32)),
        top_k=jax.device_put(np.array([r.top_k for r in rows], np.int32)),
        top_p=jax.device_put(np.array([r.top_p for r in rows], np.float32)),
        seed=jax.device_put(np.array([r.seed for r in rows], np.int32)),
        stop=jax.device_put(np.stack([r.stop for r in rows])),
        max_new=jax.device_put(np.array([r.max_new for r in rows], np.int32)),
    )


def empty_sampling_arrays(batch: int) -> SamplingArrays:
    """Greedy, no stops, budget 0: the parameters of an empty decode slot."""
    return dataclasses.replace(
        sampling_arrays([SamplingParams(max_new_tokens=1)] * batch),
        max_new=jax.device_put(np.zeros((batch,), np.int32)),
    )


# ----------------------------------------------------------------------------- the mask


def _ordered_u32(x: Array) -> Array:
    """Map f32 to uint32 so that unsigned order equals float order (``-inf`` lowest)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)  # negative floats: reverse magnitude
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _largest_key_where(pred: Callable[[Array], Array], batch: int) -> Array:
    """Per row, the largest ``uint32`` key ``t`` with ``pred(t)`` true, for a ``pred`` that
    holds on a down-set (true for every key below a true one), found bit by bit (radix
    select): 32 cheap passes, exact, with a tiny loop body (fast to compile).
    ``pred`` maps ``uint32[B, 1]`` candidates to ``bool[B]``."""

    def body(i: Array, t: Array) -> Array:
        cand = t | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(pred(cand[:, None]), cand, t)

    return jax.lax.fori_loop(0, 32, body, jnp.zeros((batch,), jnp.uint32))


def top_k_top_p_mask(logits: Array, top_k: Array, top_p: Array) -> Array:
    """``bool[B, V]``: which tokens survive top-k then top-p, per row.

    * top-k (``k > 0``): keep tokens whose logit is ``>=`` the ``k``-th largest logit
      (ties at the threshold are all kept; ``k >= V`` keeps everything).
    * top-p (``p < 1``): over the top-k survivors, renormalised, keep the smallest prefix of
      tokens sorted by probability (descending) whose cumulative probability reaches ``p``,
      i.e. a token is kept iff the mass of the tokens strictly more likely than it is
      ``< p``. The most likely token is always kept; ``p == 1`` keeps every survivor.

    No sort: both thresholds are found exactly by a 32-step radix select over the float
    bit patterns (:func:`_largest_key_where`). ``logits`` should be temperature-scaled.
    """
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    key = _ordered_u32(logits)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v).astype(jnp.int32)
    # k-th largest key: the largest t with count(key >= t) >= k.
    kth = _largest_key_where(lambda t: reduce_last((key >= t).astype(jnp.int32), "sum") >= k, b)
    keep_k = key >= kth[:, None]
    z = jnp.where(keep_k, logits, -jnp.inf)
    probs = jnp.exp(z - reduce_last(z, "max")[:, None])
    probs = probs / reduce_last(probs, "sum")[:, None]
    # Mass strictly above t is non-increasing in t; the kept tokens are those above the
    # largest t whose mass above still reaches p.
    p = top_p.astype(jnp.float32)

    def mass_above(t: Array) -> Array:
        return reduce_last(jnp.where(key > t, probs, 0.0), "sum")

    above = _largest_key_where(lambda t: mass_above(t) >= p, b)
    some_reach = mass_above(jnp.uint32(0)) >= p
    keep_p = (key > above[:, None]) | ~some_reach[:, None] | (p[:, None] >= 1.0)
    return keep_k & keep_p


# ---------------------------------------------------------------------------- sampling


def row_keys(seed: Array, t: Array) -> Array:
    """``fold_in(PRNGKey(seed[b]), t[b])`` per row: raw ``uint32[B, 2]`` keys."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, t)


def argmax(logits: Array) -> Array:
    """``jnp.argmax(logits, -1)``: the first index of the maximum, as two reductions
    (:func:`jaxlab.kernels.reduce.argmax_last`; XLA:CPU's variadic argmax reduce is slow)."""
    return argmax_last(logits)


#: Vocabulary block of the two-level inverse-CDF search (``V / BLOCK`` blocks, then one).
CDF_BLOCK = 128


def inverse_cdf(logits: Array, u: Array) -> Array:
    """Per row, the first token whose cumulative ``softmax(logits)`` mass exceeds ``u``.

    ``logits: f32[B, V]`` (``-inf`` = never drawn), ``u: f32[B]`` in ``[0, 1)``. Two
    levels so that no cumulative sum runs over the whole vocabulary: sums of blocks of
    :data:`CDF_BLOCK` tokens pick the block, then a cumulative sum inside it picks the
    token. Unnormalised weights ``exp(logits - max)`` are compared with ``u * total``.
    Float rounding can leave the target at or past the last cumulative sum; the clamps to
    the last block / token with non-zero weight keep a ``-inf`` token from ever being drawn.
    """
    b, v = logits.shape
    nb = -(-v // CDF_BLOCK)
    w = jnp.exp(logits - reduce_last(logits, "max")[:, None])
    w = jnp.pad(w, ((0, 0), (0, nb * CDF_BLOCK - v))).reshape(b, nb, CDF_BLOCK)
    block_mass = reduce_last(w, "sum")  # [B, nb]
    upto = jnp.cumsum(block_mass, axis=-1)  # mass of blocks 0..j
    target = u * upto[:, -1]
    last_block = jnp.max(jnp.where(block_mass > 0, jnp.arange(nb), 0), axis=-1)
    blk = jnp.minimum(jnp.sum(upto <= target[:, None], axis=-1), last_block)
    wb = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [B, CDF_BLOCK]
    before = jnp.take_along_axis(upto - block_mass, blk[:, None], axis=1)
    inside = before + jnp.cumsum(wb, axis=-1)
    last_tok = jnp.max(jnp.where(wb > 0, jnp.arange(CDF_BLOCK), 0), axis=-1)
    tok = jnp.minimum(jnp.sum(inside <= target[:, None], axis=-1), last_tok)
    return (blk * CDF_BLOCK + tok).astype(jnp.int32)


def filtered(logits: Array, sp: SamplingArrays) -> Array:
    """The logits a sampled row draws from: ``logits / temperature`` (greedy rows: / 1),
    ``-inf`` outside the row's top-k/top-p; ``f32[B, V]``. Their softmax is the row's
    sampling distribution (speculative acceptance compares against exactly this)."""
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = logits.astype(jnp.float32) / temp

    def masked() -> Array:
        keep = top_k_top_p_mask(scaled, sp.top_k, sp.top_p)
        return jnp.where(keep, scaled, -jnp.inf)

    # The select behind top-k/top-p only runs when some row asks for it.
    wants_filter = jnp.any(sp.top_k > 0) | jnp.any(sp.top_p < 1.0)
    return jax.lax.cond(wants_filter, masked, lambda: scaled)


def uniforms(sp: SamplingArrays, t: Array) -> Array:
    """``f32[B]``: each row's uniform of token index ``t``, the one its draw uses."""
    return jax.vmap(lambda key: jax.random.uniform(key, ()))(row_keys(sp.seed, t))


def sample(logits: Array, sp: SamplingArrays, t: Array) -> Array:
    """Next token per row: ``int32[B]`` from ``logits: f32[B, V]`` and ``t: int32[B]``."""
    logits = logits.astype(jnp.float32)
    greedy = argmax(logits)

    def stochastic() -> Array:
        drawn = inverse_cdf(filtered(logits, sp), uniforms(sp, t))
        return jnp.where(sp.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.all(sp.temperature <= 0), lambda: greedy, stochastic)


def hits_stop(tokens: Array, sp: SamplingArrays) -> Array:
    """``bool[B]``: the token is one of the row's stop ids (EOS included unless ignored)."""
    return jnp.any(tokens[:, None] == sp.stop, axis=-1)
