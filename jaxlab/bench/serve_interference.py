"""The serve suite's interference case (issue #33): what prompts arriving cost the requests
already decoding, with chunked prefill and without.

``interference_itl_p99_ratio``: 8 long streams decode while prompts of 224 tokens arrive at
a fixed interval, against two 16-slot servers, one with chunked prefill
(``serve.prefill_chunk_tokens``; a config that sets 0 measures the default) and one
without (0). The interval, the same for both servers, is twice the TTFT an arrival sees
on the chunked server while the streams decode (``loaded_arrival_ttft_s``, measured with
arrivals 8 lone TTFTs apart): arrivals keep coming without piling up in the queue. Each
round measures each server without arrivals, then with them (the servers alternate from
round to round); the ratio is the p99 gap between a stream's tokens with arrivals over
the same server's without.
Target: at most 2x with chunking; the unchunked ratio is the figure beside it, with no
target.

A gap is one token's: the servers run ``inference.stream_chunk_tokens = 1``, one token per
SSE event, except that a token whose bytes end inside a UTF-8 character rides with the
next (``tokens_per_event`` says how often). Gaps count only while every stream runs, from
the last stream's first token to the first stream's last (``running_itl_s``), so the
streams' own start and end are not in them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import CaseValue, Record
from jaxlab.bench.serve_paged import SLOTS, PagedRun, alternate, p50, ratio
from jaxlab.bench.serve_records import load_average, percentile_or_none, ratio_record

if TYPE_CHECKING:
    from jaxlab.serve.loadgen import LoadResult, RequestResult

STREAMS = 8
#: Arrivals come every ARRIVAL_GAP x the TTFT one sees among the streams: each has had its
#: prefill for about half the interval, and they never pile up in the queue.
ARRIVAL_GAP = 2.0
#: Calibration arrivals come this many lone TTFTs apart, so they seldom meet each other.
SPARSE_GAP = 8.0
TARGET_ITL_P99 = 2.0


def running_window(results: Sequence[RequestResult]) -> tuple[float, float] | None:
    """(the last first-event time, the first last-event time) of ``results``: the span in
    which every one of them was streaming; None if there is none."""
    if not results or any(not r.event_times for r in results):
        return None
    start = max(r.event_times[0] for r in results)
    end = min(r.event_times[-1] for r in results)
    return (start, end) if end > start else None


def window_gaps(results: Sequence[RequestResult], window: tuple[float, float]) -> list[float]:
    """The gaps between consecutive events of each result that lie inside ``window``."""
    start, end = window
    out = []
    for r in results:
        times = r.event_times
        out += [b - a for a, b in itertools.pairwise(times) if a >= start and b <= end]
    return out


def tokens_per_event(results: Sequence[RequestResult]) -> float | None:
    """Output tokens per SSE event with text, over ``results``."""
    events = sum(len(r.event_times) for r in results)
    return sum(r.output_tokens for r in results) / events if events else None


def interference_case(run: PagedRun) -> Iterator[Record]:
    from jaxlab.config.schema import ServeConfig
    from jaxlab.serve.loadgen import (
        closed_loop_with_arrivals,
        completion_bodies,
        make_prompts,
    )

    ctx, sh, plan = run.ctx, run.shapes, run.plan
    # The chunk the config sets; a config that turned chunking off measures the default.
    chunk = run.servers.cfg.serve.prefill_chunk_tokens or ServeConfig().prefill_chunk_tokens
    per_token = {"inference.stream_chunk_tokens": 1}
    sides = {
        c: run.servers.get(SLOTS, {**per_token, "serve.prefill_chunk_tokens": c})
        for c in (chunk, 0)
    }
    case: dict[str, CaseValue] = {
        "mode": "interference",
        "slots": SLOTS,
        "streams": STREAMS,
        "stream_prompt_len": sh.stream_prompt,
        "stream_new_tokens": sh.stream_new,
        "arrival_prompt_len": sh.arrival_prompt,
        "arrival_new_tokens": sh.arrival_new,
        "stream_chunk_tokens": 1,
    }

    def arrival_bodies(n: int, seed: int) -> list[dict[str, Any]]:
        prompts = make_prompts(n, sh.arrival_prompt, seed=seed)
        return completion_bodies(prompts, sh.arrival_new, temperature=0.0, seed=seed)

    def arrival_body(stream: int) -> Callable[[int], dict[str, Any]]:
        """Arrival ``i`` of arrival stream ``stream``: every prompt its own."""
        return lambda i: arrival_bodies(1, seed=(4000 + stream) * 100_000 + i)[0]

    def stream_bodies(seed: int) -> list[dict[str, Any]]:
        prompts = make_prompts(STREAMS, sh.stream_prompt, seed=seed)
        return completion_bodies(prompts, sh.stream_new, temperature=0.0, seed=seed)

    # The interval: ARRIVAL_GAP x the TTFT an arrival sees while the streams decode, on the
    # chunked server, measured with arrivals far apart (SPARSE_GAP x a lone arrival's TTFT).
    url = sides[chunk].url
    ctx.status("interference: the arrival interval (a lone arrival, then sparse ones)")
    lone = p50(run.closed(url, arrival_bodies(3, seed=3999), 1).samples("ttft_s"))
    loaded = None
    if lone is not None:
        _, sparse = closed_loop_with_arrivals(
            url,
            stream_bodies(2999),
            STREAMS,
            arrival_body(999),
            SPARSE_GAP * lone,
            api_key=run.api_key,
        )
        loaded = p50(sparse.samples("ttft_s"))
    if lone is None or loaded is None:
        yield ctx.failure(
            "interference_itl_p99_ratio",
            "measuring the arrival interval failed: no arrival was answered",
            case={**case, "prefill_chunk_tokens": chunk},
            unit="x",
        )
        return
    interval = ARRIVAL_GAP * loaded
    p99: dict[tuple[int, bool], list[float | None]] = {
        (c, a): [] for c in (chunk, 0) for a in (False, True)
    }
    for rnd in range(plan.rounds):
        for c in alternate([chunk, 0], rnd):
            url = sides[c].url
            for arrivals in (False, True):
                streams = stream_bodies(3000 + 10 * rnd + int(arrivals))
                ctx.status(
                    f"interference: prefill_chunk_tokens={c}, "
                    f"{'with' if arrivals else 'no'} arrivals, round {rnd + 1}"
                )
                before = _preemptions(url)
                if arrivals:
                    load, came = closed_loop_with_arrivals(
                        url, streams, STREAMS, arrival_body(rnd), interval, api_key=run.api_key
                    )
                else:
                    load, came = run.closed(url, streams, STREAMS), None
                after = _preemptions(url)
                preempted = None if before is None or after is None else after - before
                side = {**case, "prefill_chunk_tokens": c, "arrivals": arrivals, "round": rnd}
                rec = _itl_record(ctx, load, came, side, interval, preempted)
                p99[(c, arrivals)].append(rec.derived.get("itl_p99_s") if rec.ok else None)
                yield rec
    for c in (chunk, 0):
        yield ratio_record(
            ctx,
            "interference_itl_p99_ratio",
            [ratio(a, b) for a, b in zip(p99[(c, True)], p99[(c, False)], strict=True)],
            case={**case, "prefill_chunk_tokens": c, "rounds": plan.rounds},
            # The target is chunked prefill's; without it the ratio is the figure beside it.
            target=TARGET_ITL_P99 if c else None,
            better="lower",
            derived={
                "ratio_is": "p99 gap between a running stream's tokens, arrivals / none",
                "itl_p99_s": p99[(c, True)],
                "itl_p99_s_no_arrivals": p99[(c, False)],
                "arrival_interval_s": interval,
                "lone_arrival_ttft_s": lone,
                "loaded_arrival_ttft_s": loaded,
            },
            why_missing="a round failed or had too few gaps for a p99",
        )


def _preemptions(url: str) -> float | None:
    """The server's preemptions so far (None: it does not say)."""
    from jaxlab.bench.timeline import PREEMPTIONS, scrape

    try:
        return scrape(url, [PREEMPTIONS]).get(PREEMPTIONS)
    except OSError:
        return None


def _itl_record(
    ctx: BenchContext,
    load: LoadResult,
    arrivals: LoadResult | None,
    case: Mapping[str, CaseValue],
    interval_s: float,
    preemptions: float | None,
) -> Record:
    """``running_itl_s``: the streams' gaps while all of them ran (module docstring)."""
    if load.errors:
        return ctx.failure(
            "running_itl_s", f"streams failed: {load.error_summary()}", case=case, unit="s"
        )
    window = running_window(load.results)
    gaps = window_gaps(load.results, window) if window is not None else []
    if not gaps:
        return ctx.failure("running_itl_s", "the streams never ran together", case=case)
    assert window is not None
    n_min = ctx.min_samples_for_tails
    derived: dict[str, Any] = {
        "itl_p50_s": p50(gaps),
        "itl_p99_s": percentile_or_none(gaps, 99, n_min),
        "window_s": window[1] - window[0],
        "tokens_per_event": tokens_per_event(load.results),
        "output_tokens_per_s": load.output_tokens_per_s,
        # A preempted stream is recomputed: its gap then holds a prefill, not interference.
        "preemptions": preemptions,
        "loadavg_1m": load_average(),
    }
    if arrivals is not None:
        derived |= {
            "arrivals": len(arrivals.results),
            "arrival_errors": arrivals.errors,
            "arrival_interval_s": interval_s,
            "arrival_ttft_p50_s": p50(arrivals.samples("ttft_s")),
        }
    return ctx.record("running_itl_s", "s", gaps, case=case, derived=derived)


__all__ = [
    "STREAMS",
    "interference_case",
    "running_window",
    "tokens_per_event",
    "window_gaps",
]
