"""Compare two runs case by case: ratio of medians and an honest noise mark.

Records match on ``(suite, case, metric)``. For each match the ratio is
``median(B) / median(A)``. The verdict:

* ``noise`` — the two spread intervals ``[median - 2·MAD, median + 2·MAD]`` overlap (MAD:
  median absolute deviation of the raw samples), or either side has fewer than
  ``MIN_SAMPLES`` samples (its spread is unknown, so no difference can be claimed);
* ``faster`` / ``slower`` — the intervals are disjoint; for ``better = "lower"`` metrics
  (times) a ratio below 1 is ``faster``, for ``better = "higher"`` (throughputs) above 1;
* ``failed`` — either record failed (no median to compare).

This is a heuristic, not a significance test: it only refuses to call a difference that
sits inside what the samples themselves show as run-to-run spread. Cases present on only
one side are listed, never silently dropped, and environment differences (CPU, devices,
library versions) are reported as warnings, because such a comparison is not valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from jaxlab.bench.record import Record, same_machine_warnings

MIN_SAMPLES = 3
SPREAD_MADS = 2.0

Verdict = Literal["faster", "slower", "noise", "failed"]


@dataclass
class CompareRow:
    suite: str
    case: dict[str, Any]
    metric: str
    unit: str
    better: str
    a_median: float | None
    b_median: float | None
    ratio: float | None
    verdict: Verdict
    reason: str
    a_n: int
    b_n: int


@dataclass
class Comparison:
    rows: list[CompareRow] = field(default_factory=list)
    only_a: list[dict[str, Any]] = field(default_factory=list)
    only_b: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    run_a: list[str] = field(default_factory=list)
    run_b: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {"faster": 0, "slower": 0, "noise": 0, "failed": 0}
        for r in self.rows:
            out[r.verdict] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "counts": self.counts(),
            "rows": [asdict(r) for r in self.rows],
            "only_a": self.only_a,
            "only_b": self.only_b,
            "warnings": self.warnings,
        }


def interval(r: Record) -> tuple[float, float]:
    """The spread interval ``median ± 2·MAD`` of an ok record."""
    m, mad = r.stats.median, r.stats.mad
    assert m is not None and mad is not None
    return (m - SPREAD_MADS * mad, m + SPREAD_MADS * mad)


def verdict(a: Record, b: Record) -> tuple[float | None, Verdict, str]:
    """``(ratio B/A, verdict, reason)`` for two records of the same case."""
    if not (a.ok and b.ok):
        side = "A" if not a.ok else "B"
        return None, "failed", f"{side} failed: {(a if not a.ok else b).error}"
    ma, mb = a.stats.median, b.stats.median
    assert ma is not None and mb is not None
    ratio = mb / ma if ma != 0 else None
    if len(a.samples) < MIN_SAMPLES or len(b.samples) < MIN_SAMPLES:
        return ratio, "noise", f"fewer than {MIN_SAMPLES} samples on a side: spread unknown"
    (alo, ahi), (blo, bhi) = interval(a), interval(b)
    if alo <= bhi and blo <= ahi:
        return ratio, "noise", "median ± 2·MAD intervals overlap"
    b_lower = mb < ma
    better = b_lower if a.better == "lower" else not b_lower
    return ratio, "faster" if better else "slower", "median ± 2·MAD intervals are disjoint"


def _index(records: Sequence[Record], side: str, warnings: list[str]) -> dict[tuple, Record]:
    out: dict[tuple, Record] = {}
    for r in records:
        if r.key in out:
            warnings.append(
                f"{side} has more than one record for {r.suite} {r.metric} {r.case}; "
                "the last one is compared"
            )
        out[r.key] = r
    return out


def _describe(r: Record) -> dict[str, Any]:
    return {"suite": r.suite, "case": r.case, "metric": r.metric, "status": r.status}


def compare(records_a: Sequence[Record], records_b: Sequence[Record]) -> Comparison:
    """Match ``records_b`` against ``records_a`` case by case (B relative to A)."""
    out = Comparison(
        run_a=sorted({r.run_id for r in records_a}), run_b=sorted({r.run_id for r in records_b})
    )
    out.warnings.extend(same_machine_warnings(records_a, records_b))
    ia = _index(records_a, "A", out.warnings)
    ib = _index(records_b, "B", out.warnings)
    for key, a in ia.items():
        b = ib.get(key)
        if b is None:
            out.only_a.append(_describe(a))
            continue
        ratio, v, reason = verdict(a, b)
        if a.unit != b.unit or a.better != b.better:
            reason = f"unit/direction differ ({a.unit}/{a.better} vs {b.unit}/{b.better})"
            ratio, v = None, "failed"
        out.rows.append(
            CompareRow(
                suite=a.suite,
                case=a.case,
                metric=a.metric,
                unit=a.unit,
                better=a.better,
                a_median=a.stats.median,
                b_median=b.stats.median,
                ratio=ratio,
                verdict=v,
                reason=reason,
                a_n=len(a.samples),
                b_n=len(b.samples),
            )
        )
    out.only_b = [_describe(b) for key, b in ib.items() if key not in ia]
    return out
