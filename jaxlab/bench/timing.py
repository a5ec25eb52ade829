"""Timing rules, in code: warm-up untimed, every repetition blocks on its result.

``measure`` calls ``fn`` ``warmup`` times without timing it (compilation, caches, allocator
growth), then ``repeats`` times with ``time.perf_counter`` around ``fn()`` *and* the wait for
its result: JAX dispatches asynchronously, so without ``block_until_ready`` a timer measures
how fast work is queued, not how fast it runs. Every raw sample is kept.

An exception inside the measured callable (warm-up or timed) never escapes and is never
dropped: the returned :class:`Samples` carries the error text and whatever samples were
taken before it, and the caller turns it into a ``status = "failed"`` record.
``KeyboardInterrupt`` and other ``BaseException`` s still propagate.

This module does not import jax at import time; the default ``sync`` imports it on first use.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def block_until_ready(out: Any) -> Any:
    """Wait until every array in the output pytree is computed (``jax.block_until_ready``)."""
    import jax

    return jax.block_until_ready(out)


def no_sync(out: Any) -> Any:
    """For host-only work (tokenizers, file I/O): the result is ready when ``fn`` returns."""
    return out


def describe_error(exc: BaseException) -> str:
    """``Type: message (at file:line in function)`` for the innermost frame."""
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name})"
    return text


@dataclass
class Samples:
    """Raw wall-clock samples in seconds, or the failure that stopped sampling."""

    times_s: list[float] = field(default_factory=list)
    warmup: int = 0
    repeats: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def failed(cls, error: str, *, times_s: list[float] | None = None) -> Samples:
        return cls(times_s=list(times_s or []), error=error)


def measure(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeats: int,
    sync: Callable[[Any], Any] = block_until_ready,
    clock: Callable[[], float] = time.perf_counter,
    before: Callable[[], Any] | None = None,
    warm_each: int = 0,
) -> Samples:
    """Time ``repeats`` calls of ``fn`` (each followed by ``sync`` on its result).

    ``warmup`` calls come first and are not timed (but are synced, so queued work cannot
    leak into the first timed sample). ``before``, when given, runs ahead of every call,
    warm-up included, outside the timed region: it settles what the previous call left
    behind (e.g. waits for an async save to finish, so the next sample does not time
    that wait) or starts work that the timed call must overlap with. ``warm_each`` more
    untimed calls run right before each timed one (after ``before``): when ``before`` ran
    something else that filled the caches (the peer suite's other side), the timed call
    still starts with the caches its own previous call leaves, as in a steady loop.
    """
    if warmup < 0 or repeats < 1 or warm_each < 0:
        raise ValueError(
            "measure: need warmup >= 0, repeats >= 1 and warm_each >= 0 "
            f"(got {warmup}, {repeats}, {warm_each})"
        )
    times: list[float] = []
    where = "warm-up call 1"
    try:
        for i in range(warmup):
            where = f"warm-up call {i + 1} of {warmup}"
            if before is not None:
                before()
            sync(fn())
        for i in range(repeats):
            where = f"repetition {i + 1} of {repeats}"
            if before is not None:
                before()
            for _ in range(warm_each):
                sync(fn())
            t0 = clock()
            sync(fn())
            times.append(clock() - t0)
    except Exception as e:
        return Samples(times, warmup, repeats, error=f"{describe_error(e)} during {where}")
    return Samples(times, warmup, repeats)


def time_once(
    fn: Callable[[], Any],
    *,
    sync: Callable[[Any], Any] = no_sync,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, Any]:
    """``(seconds, result)`` of one call plus ``sync``; exceptions propagate to the caller."""
    t0 = clock()
    out = sync(fn())
    return clock() - t0, out
