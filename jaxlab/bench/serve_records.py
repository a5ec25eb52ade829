"""The records of one load run of the serve suite, and the ratio records of its comparisons.

:func:`run_records` turns a :class:`~jaxlab.serve.loadgen.LoadResult` into an ``e2e_s``
record (derived: requests/s, output tokens/s, errors, TTFT p50/p99, prompt tokens and the
prefix-cache hits the server reported, the machine's load average and, with the server
in-process, the cores the process kept busy) and ``ttft_s``, ``tpot_s`` and ``itl_s``
records. :func:`ratio_record` is a comparison's ratio, one sample per interleaved round,
held against its target. Tails follow the harness rule (withheld under
``bench.min_samples_for_tails`` samples).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxlab.bench.context import BenchContext, Better
from jaxlab.bench.record import CaseValue, Record

if TYPE_CHECKING:
    from jaxlab.serve.loadgen import LoadResult


def percentile_or_none(values: Sequence[float], q: float, min_n: int) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``; None under ``min_n`` values."""
    from jaxlab.bench.stats import percentile

    if len(values) < min_n:
        return None
    return percentile(sorted(values), q / 100)


def load_average() -> float | None:
    """The machine's 1-minute load average now (None where the OS has none): on a shared
    machine, how many other runnable processes a measurement competed with."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def run_records(
    ctx: BenchContext,
    load: LoadResult,
    case: Mapping[str, CaseValue],
    extra: Mapping[str, Any] | None = None,
    *,
    in_process: bool,
) -> Iterator[Record]:
    """The records of one load run (module docstring). ``in_process``: server and clients
    share this process, so its CPU time is the whole stack's and ``process_cpu_cores``
    means something."""
    from jaxlab.bench.stats import median

    n_min = ctx.min_samples_for_tails
    ttft = load.samples("ttft_s")
    if load.errors or not load.ok:
        # Output tokens/s over the wall time of a load some of whose requests failed counts
        # only the rest: a figure for a load the server did not serve. The record fails and
        # says what went wrong (a 504 is serve.request_timeout_s, a 429 serve.max_queue).
        what = (
            "every request failed"
            if not load.ok
            else f"{load.errors} of {len(load.results)} requests failed"
        )
        yield ctx.failure(
            "e2e_s",
            f"{what}: {load.error_summary()} (status or error: count); no throughput is given"
            " for a load the server did not serve whole",
            case=case,
            unit="s",
        )
        return
    derived: dict[str, Any] = {
        "requests_per_s": load.requests_per_s,
        "output_tokens_per_s": load.output_tokens_per_s,
        "requests": len(load.results),
        "errors": load.errors,
        "error_kinds": load.error_summary(),
        "wall_s": load.wall_s,
        "ttft_p50_s": median(ttft) if ttft else None,
        "ttft_p99_s": percentile_or_none(ttft, 99, n_min),
        "prompt_tokens": load.prompt_tokens,
        "cached_tokens": load.cached_tokens,
        **(extra or {}),
    }
    if in_process:
        derived |= {"process_cpu_cores": load.cpu_cores, "cpu_count": os.cpu_count()}
    derived["loadavg_1m"] = load_average()
    yield ctx.record("e2e_s", "s", load.samples("e2e_s"), case=case, derived=derived)
    for metric in ("ttft_s", "tpot_s", "itl_s"):
        samples = load.samples(metric)
        if samples:
            yield ctx.record(metric, "s", samples, case=case)


def meets(ratios: Sequence[float], target: float, better: Better) -> bool:
    """Every round meets ``target``: at least it (``higher``) or at most it (``lower``)."""
    if not ratios:
        return False
    return min(ratios) >= target if better == "higher" else max(ratios) <= target


def ratio_record(
    ctx: BenchContext,
    metric: str,
    ratios: Sequence[float | None],
    *,
    case: Mapping[str, CaseValue],
    target: float | None,
    better: Better = "higher",
    derived: Mapping[str, Any] | None = None,
    why_missing: str = "a comparison round failed",
) -> Record:
    """A comparison's ratio (unit ``x``), one sample per round (None: that round could not
    give one, and the record fails saying ``why_missing``). ``meets_target`` asks
    ``target`` of every round; a ratio with no target (None) carries none."""
    if not ratios or any(r is None for r in ratios):
        return ctx.failure(metric, why_missing, case=case, unit="x")
    got = [float(r) for r in ratios if r is not None]
    verdict = {}
    if target is not None:
        verdict = {
            "target": target,
            "target_is": "at least" if better == "higher" else "at most",
            "meets_target": meets(got, target, better),
        }
    return ctx.record(
        metric, "x", got, case=case, better=better, derived={**(derived or {}), **verdict}
    )


__all__ = ["load_average", "meets", "percentile_or_none", "ratio_record", "run_records"]
