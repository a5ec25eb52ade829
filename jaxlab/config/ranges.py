"""The valid range of every numeric sampling value: one table for every place that checks one.

:meth:`jaxlab.infer.sampling.SamplingParams.problem` (the request check of the CLI's
``generate``, offline generation and the server), the server's request bodies
(:mod:`jaxlab.serve.protocol`, whose 400 names the HTTP field) and the ``inference.*``
defaults check against these ranges, so a value refused in one place is refused in all.

Each bound keeps the value exact in the dtype the device holds it in (budgets, top-k and
seeds are int32; temperature and top-p are float32) and meaningful:

- temperature 0 is greedy; a positive one is at least 0.01 (below it the draw is nearly
  the argmax, and far below it the scaled logits leave float32's range and the
  probabilities turn NaN) and at most 100 (past it the draw is nearly uniform);
- top-p is at least 1e-6: any top-p under the most likely token's probability keeps that
  token alone, while one that float32 rounds to 0 would keep no token at all;
- a seed fits a non-negative int32, so the device's ``PRNGKey(seed)`` equals the host's.

Import-light: no jax (the server's HTTP layer loads before the model does).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

INT32_MAX = 2**31 - 1


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for an error message."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's int-to-str digit limit
        return "an integer of more than 4300 digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """Values in ``[lo, hi]``, whole numbers if ``integer``. ``zero`` names what 0 means when
    0 lies outside ``[lo, hi]`` and is still valid (temperature: greedy); ``note`` names a
    special value inside it ("0 = off")."""

    lo: float
    hi: float
    integer: bool = False
    zero: str | None = None
    note: str = ""

    def describe(self) -> str:
        """The range in words: ``an integer in [0, 2147483647], 0 = off``."""
        kind = "an integer" if self.integer else "a number"
        text = f"{kind} in [{_num(self.lo)}, {_num(self.hi)}]"
        if self.zero is not None:
            text = f"0 ({self.zero}) or {text}"
        return f"{text}, {self.note}" if self.note else text

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(
            value, numbers.Integral if self.integer else numbers.Real
        ):
            return False
        if self.zero is not None and value == 0:
            return True
        return bool(self.lo <= value <= self.hi)  # type: ignore[operator]  # NaN: False

    def problem(self, name: str, value: object) -> str | None:
        """None if ``value`` is valid, else a message naming ``name``, the range and ``value``."""
        if self.contains(value):
            return None
        return f"{name} must be {self.describe()} (got {shown(value)})"


MAX_NEW_TOKENS = Range(1, INT32_MAX, integer=True)
TEMPERATURE = Range(0.01, 100.0, zero="greedy")
TOP_K = Range(0, INT32_MAX, integer=True, note="0 = off")
TOP_P = Range(1e-6, 1.0, note="1 = off")
SEED = Range(0, INT32_MAX, integer=True)

#: ``SamplingParams`` (and ``inference.*``) field -> its range.
SAMPLING_RANGES: dict[str, Range] = {
    "max_new_tokens": MAX_NEW_TOKENS,
    "temperature": TEMPERATURE,
    "top_k": TOP_K,
    "top_p": TOP_P,
    "seed": SEED,
}

__all__ = [
    "INT32_MAX",
    "MAX_NEW_TOKENS",
    "SAMPLING_RANGES",
    "SEED",
    "TEMPERATURE",
    "TOP_K",
    "TOP_P",
    "Range",
    "shown",
]
