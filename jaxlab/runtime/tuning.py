"""Platform-specific op forms, chosen once per process from the JAX backend.

Each switch here selects between two forms of the *same* function: the plain form, which is
the readable reference, and a form that XLA compiles better on one platform. A test checks
every tuned form against its reference (``tests/kernels``, ``tests/infer``), so a switch can
change speed, never results beyond float summation order. The measurements behind each
choice are in ``docs/performance.md``.

What this module must not do: hold numerics policy (dtypes live in the config) or choose the
attention kernel (``jaxlab.kernels.resolve`` does, by the same platform). Vendor-specific
XLA flags live beside it, in :mod:`jaxlab.runtime.platform`.

Importing this module does not import jax; :func:`current` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

#: The most slots a TPU decode loop unrolls: measured faster at 1, 4 and 8 slots, slower
#: at 32 (docs/performance.md, "Two decode steps per loop trip").
UNROLL_ROWS_TPU = 8


@dataclass(frozen=True)
class Tuning:
    """The op forms a platform gets. ``False`` everywhere is the reference."""

    #: Reduce a minor (last) axis in two stages, ``[..., n/w, w]`` then ``w``: XLA:CPU emits
    #: a minor-axis reduction as a scalar loop per row, and the two-stage form vectorises.
    two_stage_reductions: bool = False
    #: Keep a ``[d_model, vocab]`` copy of a tied LM head for decoding: XLA:CPU's few-row dot
    #: that contracts the ``[vocab, d_model]`` table's minor axis is much slower.
    transposed_head: bool = False
    #: Decode only the leading rows up to the last active slot (a ``lax.switch`` over row
    #: counts): on XLA:CPU a step's time grows with its rows. Off on accelerators, on the
    #: premise that their step barely depends on its rows; the TPU v5e's paged decode step
    #: does depend on them (docs/performance.md), and buckets are untried there.
    row_buckets: bool = False
    #: Decode from a contiguous copy of the rows' pages, made once per decode call
    #: (:mod:`jaxlab.kernels.staged`): XLA:CPU copies the pages a step reads before every
    #: step's dots otherwise. Costs a contiguous cache's memory while a call runs.
    staged_pages: bool = False
    #: Decode loops over at most this many slots run two steps per loop trip
    #: (``inference.decode_unroll`` overrides it). XLA prefetches weights into fast memory
    #: within a loop body, not across its trips, so a one-step body starts every step
    #: waiting for its first weights; a two-step body hides the second step's behind the
    #: first. A TPU's small-batch step is that weight stream; at 32 rows the longer body
    #: was slower (not profiled).
    unroll_decode_rows: int = 0


#: The reference forms: accelerators compile them well.
REFERENCE = Tuning()
#: XLA:CPU.
CPU = Tuning(two_stage_reductions=True, transposed_head=True, row_buckets=True, staged_pages=True)
#: A TPU: the reference forms, and the small-batch decode loop unrolled.
TPU = Tuning(unroll_decode_rows=UNROLL_ROWS_TPU)


def tuning_for(platform: str) -> Tuning:
    """The tuning of a JAX platform name (``"cpu"``, ``"tpu"``, ``"gpu"``, ...)."""
    return {"cpu": CPU, "tpu": TPU}.get(platform, REFERENCE)


@functools.cache
def current() -> Tuning:
    """The tuning of this process's default JAX backend (decided once, at first use)."""
    import jax

    return tuning_for(jax.default_backend())


__all__ = ["CPU", "REFERENCE", "TPU", "Tuning", "current", "tuning_for"]
