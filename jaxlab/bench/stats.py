"""Summary statistics of raw samples: pure Python, no jax, no numpy needed.

Tail percentiles need data: with fewer than ``min_samples_for_tails`` samples (default 20)
``p90`` and ``p99`` are ``None`` and ``tails_withheld`` is true with the reason — a p99 of
ten samples is the maximum under another name, and reporting it would be a lie.

Percentiles use linear interpolation between closest ranks (numpy's default ``linear``
method): the q-quantile of sorted ``x[0..n-1]`` sits at position ``(n - 1) * q``.
``std`` is the sample standard deviation (``n - 1`` in the denominator; ``None`` below 2
samples). ``mad`` is the median absolute deviation from the median (unscaled), which
``compare`` uses as its spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

DEFAULT_MIN_SAMPLES_FOR_TAILS = 20


class Stats(BaseModel):
    """Statistics of one measurement's samples (all in the record's unit)."""

    model_config = ConfigDict(extra="forbid")

    n: int
    mean: float | None
    median: float | None
    std: float | None
    min: float | None
    max: float | None
    mad: float | None
    p90: float | None
    p99: float | None
    tails_withheld: bool
    tails_reason: str | None = None

    @property
    def median_value(self) -> float:
        """The median as a plain float, for ``derive`` functions (raises if there is none)."""
        if self.median is None:
            raise ValueError(f"no median: {self.tails_reason or 'no samples'}")
        return self.median


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1] (got {q})")
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 0.5)


def summarize(
    samples: Sequence[float],
    *,
    min_samples_for_tails: int = DEFAULT_MIN_SAMPLES_FOR_TAILS,
    withheld_reason: str | None = None,
) -> Stats:
    """Statistics of ``samples``; ``withheld_reason`` forces every statistic to ``None``."""
    if min_samples_for_tails < 1:
        raise ValueError(f"min_samples_for_tails must be >= 1 (got {min_samples_for_tails})")
    xs = sorted(float(x) for x in samples)
    n = len(xs)
    if withheld_reason is not None or n == 0:
        return Stats(
            n=n,
            mean=None,
            median=None,
            std=None,
            min=None,
            max=None,
            mad=None,
            p90=None,
            p99=None,
            tails_withheld=True,
            tails_reason=withheld_reason or "no samples",
        )
    if any(not math.isfinite(x) for x in xs):
        raise ValueError("samples must be finite numbers")
    mean = math.fsum(xs) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1)) if n >= 2 else None
    med = percentile(xs, 0.5)
    mad = median([abs(x - med) for x in xs])
    tails = n >= min_samples_for_tails
    return Stats(
        n=n,
        mean=mean,
        median=med,
        std=std,
        min=xs[0],
        max=xs[-1],
        mad=mad,
        p90=percentile(xs, 0.90) if tails else None,
        p99=percentile(xs, 0.99) if tails else None,
        tails_withheld=not tails,
        tails_reason=None if tails else f"n={n} < min_samples_for_tails={min_samples_for_tails}",
    )
