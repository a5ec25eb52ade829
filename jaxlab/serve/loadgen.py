"""A load generator for ``/v1/completions`` with streaming (aiohttp client sessions).

Three arrival patterns:

- **closed loop** (:func:`closed_loop`): ``concurrency`` workers, each sending its next
  request as soon as the previous one finished: throughput at a fixed number in flight.
- **open loop** (:func:`poisson`): requests start at Poisson arrival times (exponential
  gaps, seeded) whatever the server's state: latency under an offered rate.
- **a closed loop under arrivals** (:func:`closed_loop_with_arrivals`): a closed loop while
  other requests keep arriving at a fixed interval, until the loop's requests are done:
  what new arrivals cost the requests already running.

Per request it measures, on the client: TTFT (send to the first SSE event with text),
the gaps between SSE events (ITL; one event carries up to ``inference.stream_chunk_tokens``
tokens), TPOT ((last - first event) / (tokens - 1)) and end-to-end latency; the output
token count is the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
and the prompt tokens the server found in its prefix cache are
``usage.prompt_tokens_details.cached_tokens`` (None where the server reports none).

The client is aiohttp rather than httpx because the client's own cost per request sits on a
closed loop's critical path: when a wave of answers ends, the next requests reach the
server only after the clients have processed the answers and sent the new requests, and
aiohttp's cost per request is several times lower than httpx's (measured in
docs/serving.md, "Load benchmark"). Each stream is read to its end, after ``[DONE]``, so
the connection goes back to the pool and the next request reuses it.

A client only: it imports nothing of the server and loads any URL that speaks the API:
``http(s)://HOST:PORT[/prefix]``, or ``unix:PATH`` for a server on a unix socket
(``jaxlab serve --uds PATH``), reached through ``aiohttp.UnixConnector``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestResult:
    ok: bool
    status: int
    t_start: float
    t_end: float
    ttft_s: float | None = None
    event_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.event_times)]

    @property
    def tpot_s(self) -> float | None:
        if len(self.event_times) < 2 or self.output_tokens < 2:
            return None
        return (self.event_times[-1] - self.event_times[0]) / (self.output_tokens - 1)


@dataclass
class LoadResult:
    """All requests of one run and the wall time from the first send to the last answer.

    ``cpu_s`` is this process's CPU time (every thread, ``time.process_time``) over the same
    interval: with the server in-process, ``cpu_s / wall_s`` says how many cores the whole
    stack kept busy, clients included.
    """

    results: list[RequestResult]
    wall_s: float
    cpu_s: float = float("nan")

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> int:
        return sum(not r.ok for r in self.results)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the server served from its prefix cache, over the answered requests;
        None when no answer reported any (a server without prefix caching)."""
        reported = [r.cached_tokens for r in self.ok if r.cached_tokens is not None]
        return sum(reported) if reported else None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.ok)

    @property
    def requests_per_s(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def cpu_cores(self) -> float:
        """CPU seconds per wall second: how many cores the process kept busy."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    def samples(self, name: str) -> list[float]:
        """Per-request ``ttft_s``, ``tpot_s``, ``e2e_s``; per-event ``itl_s``."""
        if name == "itl_s":
            return [x for r in self.ok for x in r.itl_s]
        values = [getattr(r, name) for r in self.ok]
        return [float(v) for v in values if v is not None]

    def error_summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            if not r.ok:
                key = str(r.status) if r.status else (r.error or "error").split(":")[0]
                out[key] = out.get(key, 0) + 1
        return out


#: The characters of generated prompts: one byte-tokenizer token each.
PROMPT_ALPHABET = "abcdefghijklmnopqrstuvwxyz     "


def make_prompts(n: int, length: int, seed: int = 0) -> list[str]:
    """``n`` random lowercase-and-space strings of ``length`` characters (one byte-tokenizer
    token per character)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_ALPHABET) for _ in range(length)) for _ in range(n)]


def make_shared_prefix_prompts(
    n: int, prefix_len: int, suffix_len: int, seed: int = 0
) -> list[str]:
    """``n`` prompts of ``prefix_len + suffix_len`` characters: one random prefix shared by
    all, then a suffix of each prompt's own, no two alike (characters as
    :func:`make_prompts`)."""
    rng = random.Random(seed)
    prefix = "".join(rng.choice(PROMPT_ALPHABET) for _ in range(prefix_len))
    suffixes: dict[str, None] = {}  # insertion-ordered set
    for _ in range(100 * n):
        if len(suffixes) == n:
            break
        suffixes["".join(rng.choice(PROMPT_ALPHABET) for _ in range(suffix_len))] = None
    if len(suffixes) < n:
        raise ValueError(f"cannot draw {n} distinct suffixes of {suffix_len} characters")
    return [prefix + s for s in suffixes]


def completion_bodies(
    prompts: Sequence[str],
    max_tokens: int,
    *,
    model: str | None = None,
    temperature: float = 0.8,
    ignore_eos: bool = True,
    seed: int = 0,
) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        body: dict[str, Any] = {
            "prompt": p,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed + i,
            "ignore_eos": ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model is not None:
            body["model"] = model
        out.append(body)
    return out


#: ``unix:PATH``: a server listening on the unix socket ``PATH``.
UNIX_SCHEME = "unix:"


def unix_socket(url: str) -> str | None:
    """The socket path of a ``unix:PATH`` URL, else None."""
    return url[len(UNIX_SCHEME) :] if url.startswith(UNIX_SCHEME) else None


def completions_url(url: str) -> str:
    """The ``/v1/completions`` endpoint under a server's base ``url`` (which may carry a path
    prefix, e.g. behind a proxy). Over a unix socket (``unix:PATH``) the host part is only
    the ``Host`` header: ``http://localhost/v1/completions``."""
    if unix_socket(url) is not None:
        return "http://localhost/v1/completions"
    return url.rstrip("/") + "/v1/completions"


def server_info(url: str, *, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the server at ``url`` says of itself (its ``/ready`` document: platform,
    precision, slots, KV pages...), or ``{}`` if it does not answer with one: a record of a
    server in another process must name the server's device, not the client's."""

    async def get() -> dict[str, Any]:
        endpoint = completions_url(url).removesuffix("/v1/completions") + "/ready"
        async with (
            _session(api_key, 1, timeout_s, url=url) as session,
            session.get(endpoint) as r,
        ):
            doc = await r.json(content_type=None)
        return doc if isinstance(doc, dict) else {}

    try:
        return asyncio.run(get())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


async def one_request(
    session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any]
) -> RequestResult:
    """One streamed completion against ``endpoint`` (:func:`completions_url`)."""
    t0 = time.perf_counter()
    res = RequestResult(ok=False, status=0, t_start=t0, t_end=t0)
    try:
        async with session.post(endpoint, json=body) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.text())[:200]
                return res
            done = False
            async for raw in r.content:  # one SSE line per item
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue  # read on to the end of the stream: the connection is reused
                doc = json.loads(data)
                if "error" in doc:
                    res.error = str(doc["error"].get("message"))
                    return res
                if usage := doc.get("usage"):
                    res.output_tokens = int(usage["completion_tokens"])
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
                choices = doc.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - t0
                    res.event_times.append(now)
            res.ok = done
            if not done:
                res.error = "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.t_end = time.perf_counter()
    return res


def _session(
    api_key: str | None, connections: int, timeout_s: float, *, url: str | None = None
) -> aiohttp.ClientSession:
    """A client session of ``connections`` connections: TCP, or to the socket of a
    ``unix:PATH`` ``url``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = None if url is None else unix_socket(url)
    connector = (
        aiohttp.TCPConnector(limit=connections)
        if path is None
        else aiohttp.UnixConnector(path=path, limit=connections)
    )
    return aiohttp.ClientSession(
        headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s), connector=connector
    )


async def closed_loop_async(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> LoadResult:
    todo = list(reversed(bodies))
    results: list[RequestResult] = []
    endpoint = completions_url(url)
    async with _session(api_key, concurrency, timeout_s, url=url) as session:

        async def worker() -> None:
            while todo:
                results.append(await one_request(session, endpoint, todo.pop()))

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return LoadResult(results, wall, cpu)


async def poisson_async(
    url: str,
    bodies: Sequence[dict[str, Any]],
    rate_per_s: float,
    *,
    seed: int = 0,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> LoadResult:
    rng = random.Random(seed)
    endpoint = completions_url(url)
    async with _session(api_key, max(len(bodies), 1), timeout_s, url=url) as session:
        t0, c0 = time.perf_counter(), time.process_time()
        tasks = []
        t_next = 0.0
        for body in bodies:
            delay = t0 + t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one_request(session, endpoint, body)))
            t_next += rng.expovariate(rate_per_s)
        results = list(await asyncio.gather(*tasks))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return LoadResult(results, wall, cpu)


async def closed_loop_with_arrivals_async(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    arrival_body: Callable[[int], dict[str, Any]],
    interval_s: float,
    *,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> tuple[LoadResult, LoadResult]:
    """A closed loop over ``bodies`` while request ``arrival_body(i)`` arrives at ``t0 + i *
    interval_s`` (i = 0, 1, ...) until the loop's last request is answered; returns (the
    loop's result, the arrivals' result). Arrivals still in flight then are awaited."""
    loop_task = asyncio.ensure_future(
        closed_loop_async(url, bodies, concurrency, api_key=api_key, timeout_s=timeout_s)
    )
    endpoint = completions_url(url)
    async with _session(api_key, 1024, timeout_s) as session:
        t0, c0 = time.perf_counter(), time.process_time()
        tasks: list[asyncio.Future[RequestResult]] = []
        for i in itertools.count():
            delay = t0 + i * interval_s - time.perf_counter()
            if delay > 0:
                await asyncio.wait([loop_task], timeout=delay)
            if loop_task.done():
                break
            tasks.append(asyncio.ensure_future(one_request(session, endpoint, arrival_body(i))))
        results = list(await asyncio.gather(*tasks))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return loop_task.result(), LoadResult(results, wall, cpu)


def closed_loop(
    url: str, bodies: Sequence[dict[str, Any]], concurrency: int, **kw: Any
) -> LoadResult:
    return asyncio.run(closed_loop_async(url, bodies, concurrency, **kw))


def poisson(url: str, bodies: Sequence[dict[str, Any]], rate_per_s: float, **kw: Any) -> LoadResult:
    return asyncio.run(poisson_async(url, bodies, rate_per_s, **kw))


def closed_loop_with_arrivals(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    arrival_body: Callable[[int], dict[str, Any]],
    interval_s: float,
    **kw: Any,
) -> tuple[LoadResult, LoadResult]:
    return asyncio.run(
        closed_loop_with_arrivals_async(url, bodies, concurrency, arrival_body, interval_s, **kw)
    )


__all__ = [
    "PROMPT_ALPHABET",
    "LoadResult",
    "RequestResult",
    "closed_loop",
    "closed_loop_async",
    "closed_loop_with_arrivals",
    "closed_loop_with_arrivals_async",
    "completion_bodies",
    "completions_url",
    "make_prompts",
    "make_shared_prefix_prompts",
    "one_request",
    "poisson",
    "poisson_async",
    "server_info",
]
