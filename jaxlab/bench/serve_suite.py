"""The ``serve`` suite: a real HTTP server under load (``jaxlab bench serve``).

Servers are started in-process (:mod:`jaxlab.bench.serve_servers`: uvicorn on a thread,
the engine on its own thread, a randomly initialised model of the configured shape, the
byte tokenizer, ``ignore_eos`` so every output length is fixed). Clients are aiohttp
sessions streaming ``/v1/completions`` (SSE). To measure a running server instead, give
its URL (``jaxlab bench serve --url URL``, ``bench.serve_url``, or the ``SERVE_BENCH_URL``
environment variable) and ``serve.api_key`` if it needs one; only the sweep and the
Poisson cases run then.

Cases:

- closed loop: concurrency 1, 4, 16, 64 (``--quick``: 1, 4, 16) against 16 slots;
- open loop: Poisson arrivals at fractions of the closed-loop capacity measured at
  concurrency 16;
- ``slots_speedup``: output tokens/s of 16 slots over 1 slot (the serialized design),
  both closed-loop at concurrency 16 (target >= 4x), greedy and sampled;
- the paged KV cache's: prefix caching and memory, with the timeline of pages in use
  (:mod:`jaxlab.bench.serve_paged`), and interference (:mod:`jaxlab.bench.serve_interference`).

Records per load run (:func:`~jaxlab.bench.serve_records.run_records`): ``e2e_s``
(derived: requests/s, output tokens/s, errors, TTFT p50 and p99 and, with the server
in-process, ``process_cpu_cores``: CPU seconds of the whole process, engine, HTTP and
clients, per wall second, beside ``cpu_count``, and the server's ``decode_groups``,
``serve.decode_groups`` resolved), ``ttft_s``, ``tpot_s`` and ``itl_s`` (gaps between SSE
events; one event carries up to ``inference.stream_chunk_tokens`` tokens). Tails follow
the harness rule (withheld under ``bench.min_samples_for_tails`` samples).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.serve_records import percentile_or_none, ratio_record, run_records
from jaxlab.bench.serve_servers import Servers, served_model
from jaxlab.bench.suites import suite

if TYPE_CHECKING:
    from jaxlab.serve.loadgen import LoadResult

URL_ENV = "SERVE_BENCH_URL"
SWEEP_SLOTS = 16
COMPARE_CONCURRENCY = 16
#: Requests per comparison round (each side gets the same ones).
COMPARE_REQUESTS = 96
TARGET_SPEEDUP = 4.0


def request_shape(ctx: BenchContext) -> tuple[int, int]:
    """(prompt_len, new_tokens) for the configured cache length."""
    cfg = ctx.config
    cap = cfg.inference.max_len or cfg.model.max_seq_len
    prompt = max(1, min(64, cap // 4))
    new = max(1, min(cfg.inference.max_new_tokens, cap - prompt - 1, 32 if ctx.quick else 128))
    return prompt, new


@suite(
    "serve",
    new_shapes=True,
    description=(
        "HTTP serving under load: concurrency sweep, Poisson, slots vs 1, paged KV cache "
        "(prefix caching, memory, interference)"
    ),
)
def serve_suite(ctx: BenchContext) -> Iterator[Record]:
    from jaxlab.bench.serve_interference import interference_case
    from jaxlab.bench.serve_paged import (
        PagedRun,
        memory_case,
        paged_plan,
        paged_shapes,
        prefix_case,
    )
    from jaxlab.serve.loadgen import (
        closed_loop,
        completion_bodies,
        make_prompts,
        poisson,
        server_info,
    )

    cfg = ctx.config
    prompt_len, new = request_shape(ctx)
    cap = cfg.inference.max_len or cfg.model.max_seq_len
    external = cfg.bench.serve_url or os.environ.get(URL_ENV)
    api_key = cfg.serve.api_key.get_secret_value() if cfg.serve.api_key is not None else None
    model = cfg.serve.model_name if external else None
    base = {"prompt_len": prompt_len, "new_tokens": new}
    timeout_s = cfg.bench.serve_request_timeout_s

    def bodies(n: int, seed: int, temperature: float = 0.0) -> list[dict[str, Any]]:
        prompts = make_prompts(n, prompt_len, seed=seed)
        return completion_bodies(prompts, new, model=model, temperature=temperature, seed=seed)

    def run(url: str, n: int, concurrency: int, seed: int, temperature: float = 0.0) -> LoadResult:
        return closed_loop(
            url, bodies(n, seed, temperature), concurrency, api_key=api_key, timeout_s=timeout_s
        )

    def warm(url: str, slots: int) -> None:
        run(url, min(4, slots), min(4, slots), seed=999)  # untimed

    served = None if external else served_model(cfg)
    # A server in another process: its records name its device beside the client's.
    server = _server_fields(server_info(external, api_key=api_key)) if external else {}
    # Any request that fits the cache may ask for its length: the paged cases need more
    # than the sweep's ``new`` tokens.
    servers = None if served is None else Servers(served, cfg, cap, warm=warm, status=ctx.status)
    groups: dict[int, int] = {}  # slots -> the server's decode groups (in-process only)

    def start(slots: int) -> str:
        if external:
            return external
        assert servers is not None
        server = servers.get(slots)
        groups[slots] = server.decode_groups
        return server.url

    try:
        # ---- closed-loop sweep and Poisson arrivals, against 16 slots
        url = start(SWEEP_SLOTS)
        slots_label = "external" if external else SWEEP_SLOTS
        capacity: float | None = None
        levels = cfg.bench.serve_concurrency or ([1, 4, 16] if ctx.quick else [1, 4, 16, 64])
        for c in levels:
            n = max(8 if ctx.quick else ctx.min_samples_for_tails, (2 if ctx.quick else 3) * c)
            case = {"mode": "closed", "concurrency": c, "slots": slots_label, **base}
            ctx.status(f"closed loop, concurrency {c}, {n} requests")
            load = run(url, n, c, seed=c)
            if c == COMPARE_CONCURRENCY and load.ok:
                capacity = load.requests_per_s
            extra = {"sampling": "greedy", **server, **_groups(groups, SWEEP_SLOTS)}
            yield from run_records(ctx, load, case, extra, in_process=not external)
        if capacity:
            n = 16 if ctx.quick else 48
            for frac in [0.7] if ctx.quick else [0.5, 0.9]:
                rate = frac * capacity
                case = {"mode": "poisson", "load": frac, "slots": slots_label, **base}
                ctx.status(f"Poisson arrivals at {rate:.2f} req/s")
                load = poisson(
                    url, bodies(n, seed=100 + n), rate, seed=7, api_key=api_key,
                    timeout_s=timeout_s,
                )  # fmt: skip
                extra = {"rate_per_s": rate, **server, **_groups(groups, SWEEP_SLOTS)}
                yield from run_records(ctx, load, case, extra, in_process=not external)
        if servers is None or served is None:
            ctx.status(f"measuring {external}: skipping the comparisons between servers")
            return

        # ---- the comparison: the same requests against 16 slots and 1 slot, interleaved
        urls = {SWEEP_SLOTS: url, 1: start(1)}
        # Six waves of the 16-slot server per round: in a round half as long, one stall of a
        # shared VM showed in the round's ratio (round lengths in docs/performance.md).
        n = 32 if ctx.quick else COMPARE_REQUESTS
        plans = [
            ("temperature=0.8", 0.8, 1 if ctx.quick else 2),
            ("greedy", 0.0, 1 if ctx.quick else 3),
        ]
        for sampling, temperature, reps in plans:
            results: dict[int, list[LoadResult]] = {SWEEP_SLOTS: [], 1: []}
            for rep in range(reps):
                for slots, u in urls.items():
                    ctx.status(f"{slots} slot(s), concurrency 16, {sampling}, round {rep + 1}")
                    load = run(u, n, COMPARE_CONCURRENCY, seed=500 + rep, temperature=temperature)
                    results[slots].append(load)
                    case = {
                        "mode": "compare",
                        "concurrency": COMPARE_CONCURRENCY,
                        "slots": slots,
                        "sampling": sampling,
                        "round": rep,
                        **base,
                    }
                    yield from run_records(ctx, load, case, _groups(groups, slots), in_process=True)
            yield _speedup(ctx, results[SWEEP_SLOTS], results[1], sampling, base, groups)

        # ---- the paged KV cache: prefix caching, memory, interference
        paged = PagedRun(
            ctx, servers, served.tokenizer, paged_shapes(cap), paged_plan(ctx.quick), api_key
        )
        yield from prefix_case(paged)
        yield from memory_case(paged)
        yield from interference_case(paged)
    finally:
        if servers is not None:
            servers.close()


def _server_fields(info: dict[str, Any]) -> dict[str, Any]:
    """The ``server_*`` fields of an external server's records, from its ``/ready``."""
    keys = ("platform", "precision", "slots", "kv_pages", "page_size")
    return {f"server_{k}": info[k] for k in keys if info.get(k) is not None}


def _groups(groups: dict[int, int], slots: int) -> dict[str, int]:
    return {"decode_groups": groups[slots]} if slots in groups else {}


def _speedup(
    ctx: BenchContext,
    many: list[LoadResult],
    one: list[LoadResult],
    sampling: str,
    base: dict[str, Any],
    groups: dict[int, int],
) -> Record:
    """One ratio per round (each round measures 16 slots, then 1 slot, back to back)."""
    case = {"concurrency": COMPARE_CONCURRENCY, "sampling": sampling, **base}
    ttft_many = [x for r in many for x in r.samples("ttft_s")]
    ttft_one = [x for r in one for x in r.samples("ttft_s")]
    n_min = ctx.min_samples_for_tails
    # The rounds that failed on either side give no ratio; the others still do.
    ratios = [
        a.output_tokens_per_s / b.output_tokens_per_s
        for a, b in zip(many, one, strict=True)
        if a.ok and b.ok and b.output_tokens_per_s > 0
    ]
    return ratio_record(
        ctx,
        "slots_speedup",
        ratios,
        case=case,
        target=TARGET_SPEEDUP,
        derived={
            "output_tokens_per_s": sum(r.output_tokens_per_s for r in many) / len(many),
            "output_tokens_per_s_1slot": sum(r.output_tokens_per_s for r in one) / len(one),
            "requests_per_s": sum(r.requests_per_s for r in many) / len(many),
            "ttft_p99_s": percentile_or_none(ttft_many, 99, n_min),
            "ttft_p99_s_1slot": percentile_or_none(ttft_one, 99, n_min),
            "process_cpu_cores": sum(r.cpu_cores for r in many) / len(many),
            "process_cpu_cores_1slot": sum(r.cpu_cores for r in one) / len(one),
            "decode_groups": groups.get(SWEEP_SLOTS),
            "decode_groups_1slot": groups.get(1),
            "errors": sum(r.errors for r in [*many, *one]),
        },
    )
