"""The serve suite's paged-KV-cache cases (issue #33): prefix caching and memory, with the
timeline of pages in use; what every paged case shares (lengths, plan, run).

Each case compares two in-process servers over the same model with the same requests in
interleaved rounds (A then B, then B then A, ...), so drift of a shared machine lands on
both sides. It yields each side's records and one ratio record per target: a sample per
round, with ``target``, ``target_is`` and ``meets_target`` (every round must meet it).

- **prefix** (``prefix_cache_ttft_speedup``, ``prefix_cache_throughput_speedup``):
  requests sharing a prefix, each with a suffix of its own, in a closed loop against two
  16-slot servers (same pool), with ``serve.prefix_caching`` on and off. Each round draws
  a new prefix, so it starts with a cold cache. ``cached_tokens`` is what the servers
  reported in ``usage.prompt_tokens_details``, the evidence that the cache hit. Targets:
  p50 TTFT off / on at least 3x, output tokens/s on / off at least 1.5x.
- **memory** (``paged_concurrency_ratio``, ``paged_throughput_speedup``): a 64-slot server
  with the KV pool of 16 slots x ``max_len`` (``inference.num_pages``) against the
  16-slot server with the same pool, in a closed loop at concurrency 64, both prefilling
  whole prompts (``serve.prefill_chunk_tokens = 0``: with a budget of prompt tokens per
  step, admission would be bounded by the budget, not by the pool). The running
  batch a server reached is the peak of ``jaxlab_num_requests_running`` scraped from
  ``/metrics`` during the run (:mod:`jaxlab.bench.timeline`). Targets: peak running at least
  4x, output tokens/s at least 1.5x.
- **timeline** (``pages_in_use``): the first memory round of the 64-slot server, scraped
  every 20 ms. Pages in use and running and waiting requests over time are stored in
  ``derived["timeline"]``, and the report draws them as ``plots/serve-timeline.png``.

The interference case is :mod:`jaxlab.bench.serve_interference`. The lengths are issue
#33's at a 256-token cache (bench-small). A shorter ``max_len`` scales each of them by
``max_len / 256``, and every case dict gives the lengths it used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import CaseValue, Record
from jaxlab.bench.serve_records import ratio_record, run_records
from jaxlab.bench.serve_servers import Server, Servers

if TYPE_CHECKING:
    from jaxlab.bench.timeline import GaugeSampler
    from jaxlab.serve.loadgen import LoadResult
    from jaxlab.tokenizer import Tokenizer

#: The cache length issue #33's lengths are stated at (bench-small's ``max_len``).
REFERENCE_LEN = 256
#: The baseline server: today's slot count, with its pool of ``SLOTS x max_len``.
SLOTS = 16
PAGED_SLOTS = 64
MEMORY_CONCURRENCY = 64
#: The memory case prefills whole prompts (as today's server does): under a per-step
#: prefill budget, admission would be bounded by that budget, not by the pool.
MEMORY_PREFILL_CHUNK = 0
#: A 64-row wave decodes for a few chunks; a scrape every 20 ms sees each wave several times.
SCRAPE_INTERVAL_S = 0.02

TARGET_PREFIX_TTFT = 3.0
TARGET_PREFIX_THROUGHPUT = 1.5
TARGET_CONCURRENCY = 4.0
TARGET_MEMORY_THROUGHPUT = 1.5


@dataclass(frozen=True)
class PagedShapes:
    """Token lengths of the cases (issue #33's at ``REFERENCE_LEN``)."""

    prefix_len: int
    suffix_len: int
    prefix_new: int
    memory_prompt: int
    memory_new: int
    stream_prompt: int
    stream_new: int
    arrival_prompt: int
    arrival_new: int


def paged_shapes(max_len: int) -> PagedShapes:
    """Issue #33's lengths, scaled by ``max_len / REFERENCE_LEN`` below it (at least 1)."""

    def scaled(n: int) -> int:
        return n if max_len >= REFERENCE_LEN else max(1, n * max_len // REFERENCE_LEN)

    return PagedShapes(
        prefix_len=scaled(192),
        suffix_len=scaled(16),
        prefix_new=scaled(32),
        memory_prompt=scaled(32),
        memory_new=scaled(32),
        stream_prompt=scaled(32),
        stream_new=scaled(192),
        arrival_prompt=scaled(224),
        arrival_new=scaled(8),
    )


@dataclass(frozen=True)
class PagedPlan:
    """How much of each case a run measures (``--quick``: one round, fewer prefix requests)."""

    rounds: int
    prefix_requests: int
    prefix_concurrency: int
    memory_requests: int


def paged_plan(quick: bool) -> PagedPlan:
    if quick:
        # Concurrency 8 of 24 requests: the first 8 meet a cold cache, the other 16 can hit.
        return PagedPlan(rounds=1, prefix_requests=24, prefix_concurrency=8, memory_requests=256)
    return PagedPlan(rounds=3, prefix_requests=48, prefix_concurrency=SLOTS, memory_requests=256)


# --------------------------------------------------------------------------- pure pieces


def check_token_exact(
    tokenizer: Tokenizer, prompts: Sequence[str], prefix_len: int, suffix_len: int
) -> None:
    """Raise ValueError unless every prompt encodes to ``prefix_len + suffix_len`` tokens
    whose first ``prefix_len`` are the same for all (the shared prefix, token for token)."""
    encoded = [tokenizer.encode(p) for p in prompts]
    want = prefix_len + suffix_len
    if any(len(ids) != want for ids in encoded):
        lengths = sorted({len(ids) for ids in encoded})
        raise ValueError(
            f"prompts encode to {lengths} tokens, not {want}: the shared-prefix case needs a "
            "tokenizer with one token per character (the byte tokenizer)"
        )
    heads = {tuple(ids[:prefix_len]) for ids in encoded}
    if len(heads) != 1:
        raise ValueError(f"the prompts do not share their first {prefix_len} tokens")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def p50(values: Sequence[float]) -> float | None:
    from jaxlab.bench.stats import median

    return median(list(values)) if values else None


def alternate(pair: Sequence[Any], rnd: int) -> list[Any]:
    """``pair`` in order on even rounds, reversed on odd ones."""
    return list(pair) if rnd % 2 == 0 else list(reversed(pair))


# --------------------------------------------------------------------------- the cases


@dataclass
class PagedRun:
    """What every case needs: the context, the servers, the lengths, the plan."""

    ctx: BenchContext
    servers: Servers
    tokenizer: Tokenizer
    shapes: PagedShapes
    plan: PagedPlan
    api_key: str | None = None

    def closed(self, url: str, bodies: list[dict[str, Any]], concurrency: int) -> LoadResult:
        from jaxlab.serve.loadgen import closed_loop

        return closed_loop(url, bodies, concurrency, api_key=self.api_key)


def prefix_case(run: PagedRun) -> Iterator[Record]:
    from jaxlab.serve.loadgen import completion_bodies, make_shared_prefix_prompts

    ctx, sh, plan = run.ctx, run.shapes, run.plan
    sides = {on: run.servers.get(SLOTS, {"serve.prefix_caching": on}) for on in (True, False)}
    case: dict[str, CaseValue] = {
        "mode": "prefix",
        "slots": SLOTS,
        "num_pages": sides[True].num_pages,
        "prefill_chunk_tokens": run.servers.cfg.serve.prefill_chunk_tokens,
        "prefix_len": sh.prefix_len,
        "suffix_len": sh.suffix_len,
        "new_tokens": sh.prefix_new,
        "requests": plan.prefix_requests,
        "concurrency": plan.prefix_concurrency,
    }
    loads: dict[bool, list[LoadResult]] = {True: [], False: []}
    for rnd in range(plan.rounds):
        # A new prefix each round: every round starts with a cold cache for it.
        prompts = make_shared_prefix_prompts(
            plan.prefix_requests, sh.prefix_len, sh.suffix_len, seed=1000 + rnd
        )
        try:
            check_token_exact(run.tokenizer, prompts, sh.prefix_len, sh.suffix_len)
        except ValueError as e:  # a BPE tokenizer: the lengths would not be the case's
            yield ctx.failure("prefix_cache_ttft_speedup", str(e), case=case, unit="x")
            return
        bodies = completion_bodies(prompts, sh.prefix_new, temperature=0.0, seed=rnd)
        for on in alternate([True, False], rnd):
            ctx.status(f"shared prefix, prefix caching {'on' if on else 'off'}, round {rnd + 1}")
            load = run.closed(sides[on].url, bodies, plan.prefix_concurrency)
            loads[on].append(load)
            side = {**case, "prefix_caching": on, "round": rnd}
            extra = {"decode_groups": sides[on].decode_groups, "kv_pages": sides[on].num_pages}
            yield from run_records(ctx, load, side, extra, in_process=True)

    def p50_ttft(load: LoadResult) -> float | None:
        return p50(load.samples("ttft_s")) if load.ok else None

    def tok_s(load: LoadResult) -> float | None:
        return load.output_tokens_per_s if load.ok else None

    on, off = loads[True], loads[False]
    per_round = {
        "ttft_p50_s": [p50_ttft(x) for x in on],
        "ttft_p50_s_off": [p50_ttft(x) for x in off],
        "output_tokens_per_s": [tok_s(x) for x in on],
        "output_tokens_per_s_off": [tok_s(x) for x in off],
        "cached_tokens": [x.cached_tokens for x in on],
        "cached_tokens_off": [x.cached_tokens for x in off],
        "prompt_tokens": [x.prompt_tokens for x in on],
        "errors": sum(x.errors for x in [*on, *off]),
    }
    yield ratio_record(
        ctx,
        "prefix_cache_ttft_speedup",
        [ratio(p50_ttft(b), p50_ttft(a)) for a, b in zip(on, off, strict=True)],
        case={**case, "rounds": plan.rounds},
        target=TARGET_PREFIX_TTFT,
        derived={"ratio_is": "p50 TTFT, prefix caching off / on", **per_round},
    )
    yield ratio_record(
        ctx,
        "prefix_cache_throughput_speedup",
        [ratio(tok_s(a), tok_s(b)) for a, b in zip(on, off, strict=True)],
        case={**case, "rounds": plan.rounds},
        target=TARGET_PREFIX_THROUGHPUT,
        derived={"ratio_is": "output tokens/s, prefix caching on / off", **per_round},
    )


def _sampled(
    run: PagedRun, server: Server, bodies: list[dict[str, Any]]
) -> tuple[LoadResult, GaugeSampler]:
    """A closed loop at ``MEMORY_CONCURRENCY`` with the server's gauges scraped meanwhile."""
    from jaxlab.bench.timeline import GaugeSampler

    with GaugeSampler(server.url, interval_s=SCRAPE_INTERVAL_S) as sampler:
        load = run.closed(server.url, bodies, MEMORY_CONCURRENCY)
    return load, sampler


def memory_case(run: PagedRun) -> Iterator[Record]:
    from jaxlab.bench.timeline import PREEMPTIONS, RUNNING
    from jaxlab.serve.loadgen import completion_bodies, make_prompts

    ctx, sh, plan = run.ctx, run.shapes, run.plan
    whole = {"serve.prefill_chunk_tokens": MEMORY_PREFILL_CHUNK}
    today = run.servers.get(SLOTS, whole)
    pool = today.num_pages
    if pool is None:
        yield ctx.failure(
            "paged_concurrency_ratio",
            "the 16-slot server's pool size is unknown (a kv_cache_mib budget): set "
            "inference.num_pages",
            case={"mode": "memory"},
            unit="x",
        )
        return
    paged = run.servers.get(PAGED_SLOTS, {**whole, "inference.num_pages": pool})
    if paged.num_pages != pool:
        yield ctx.failure(
            "paged_concurrency_ratio",
            f"the 64-slot server runs {paged.num_pages} KV pages, not the {pool} asked for",
            case={"mode": "memory", "num_pages": pool},
            unit="x",
        )
        return
    sides = {PAGED_SLOTS: paged, SLOTS: today}
    case: dict[str, CaseValue] = {
        "mode": "memory",
        "num_pages": pool,
        "prefill_chunk_tokens": MEMORY_PREFILL_CHUNK,
        "prompt_len": sh.memory_prompt,
        "new_tokens": sh.memory_new,
        "requests": plan.memory_requests,
        "concurrency": MEMORY_CONCURRENCY,
    }
    loads: dict[int, list[LoadResult]] = {PAGED_SLOTS: [], SLOTS: []}
    peaks: dict[int, list[float | None]] = {PAGED_SLOTS: [], SLOTS: []}
    timeline: GaugeSampler | None = None
    for rnd in range(plan.rounds):
        prompts = make_prompts(plan.memory_requests, sh.memory_prompt, seed=2000 + rnd)
        bodies = completion_bodies(prompts, sh.memory_new, temperature=0.0, seed=rnd)
        for slots in alternate([PAGED_SLOTS, SLOTS], rnd):
            server = sides[slots]
            ctx.status(f"memory: {slots} slots, {pool} pages, concurrency 64, round {rnd + 1}")
            load, sampler = _sampled(run, server, bodies)
            loads[slots].append(load)
            peaks[slots].append(sampler.peak(RUNNING))
            if slots == PAGED_SLOTS and timeline is None:
                timeline = sampler
            pages = [p for p in sampler.pages_used(pool) if p is not None]
            extra = {
                "running_peak": sampler.peak(RUNNING),
                "running_mean": sampler.mean(RUNNING),
                "pages_peak": max(pages, default=None),
                "preemptions": sampler.growth(PREEMPTIONS),
                "gauge_scrapes": len(sampler.t_s),
                "scrape_errors": sampler.errors,
                "decode_groups": server.decode_groups,
                "kv_pages": server.num_pages,
            }
            side = {**case, "slots": slots, "round": rnd}
            yield from run_records(ctx, load, side, extra, in_process=True)

    many, few = loads[PAGED_SLOTS], loads[SLOTS]
    per_round = {
        "running_peak": peaks[PAGED_SLOTS],
        "running_peak_16slot": peaks[SLOTS],
        "output_tokens_per_s": [x.output_tokens_per_s for x in many],
        "output_tokens_per_s_16slot": [x.output_tokens_per_s for x in few],
        "decode_groups": paged.decode_groups,
        "decode_groups_16slot": today.decode_groups,
        "errors": sum(x.errors for x in [*many, *few]),
    }
    yield ratio_record(
        ctx,
        "paged_concurrency_ratio",
        [ratio(a, b) for a, b in zip(peaks[PAGED_SLOTS], peaks[SLOTS], strict=True)],
        case={**case, "rounds": plan.rounds},
        target=TARGET_CONCURRENCY,
        derived={"ratio_is": "peak running requests, 64 slots / 16 slots", **per_round},
        why_missing="a round failed or its server's running gauge was never read",
    )
    yield ratio_record(
        ctx,
        "paged_throughput_speedup",
        [
            ratio(a.output_tokens_per_s if a.ok else None, b.output_tokens_per_s)
            for a, b in zip(many, few, strict=True)
        ],
        case={**case, "rounds": plan.rounds},
        target=TARGET_MEMORY_THROUGHPUT,
        derived={"ratio_is": "output tokens/s, 64 slots / 16 slots", **per_round},
    )
    if timeline is not None:
        yield _timeline_record(ctx, timeline, pool, {**case, "slots": PAGED_SLOTS, "round": 0})


def _timeline_record(
    ctx: BenchContext, sampler: GaugeSampler, pool: int, case: Mapping[str, CaseValue]
) -> Record:
    from jaxlab.bench.timeline import RUNNING, timeline_plot_path

    series = sampler.timeline(pool)
    pages = [p for p in series["pages_used"] if p is not None]
    if not pages:
        return ctx.failure("pages_in_use", "no /metrics scrape succeeded", case=case, unit="pages")
    return ctx.record(
        "pages_in_use",
        "pages",
        pages,
        case=case,
        derived={
            "pages_peak": max(pages),
            "running_peak": sampler.peak(RUNNING),
            "plot": timeline_plot_path(ctx.suite),
            "timeline": series,
        },
    )


__all__ = [
    "PAGED_SLOTS",
    "REFERENCE_LEN",
    "SLOTS",
    "PagedPlan",
    "PagedRun",
    "PagedShapes",
    "alternate",
    "check_token_exact",
    "memory_case",
    "p50",
    "paged_plan",
    "paged_shapes",
    "prefix_case",
    "ratio",
]
