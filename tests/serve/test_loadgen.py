"""The load generator's prompts and its closed loop under arrivals, against a fake server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jaxlab.serve.loadgen import (
    LoadResult,
    closed_loop,
    closed_loop_with_arrivals,
    completion_bodies,
    make_prompts,
    make_shared_prefix_prompts,
)


def test_make_prompts_did_not_move():
    # The sweep's prompts, and so what its committed records measured, stay the same.
    assert make_prompts(2, 12, seed=1) == ["es zycidpyop", "umzgdpa  mnt"]


def test_shared_prefix_prompts_share_a_prefix_and_differ_after_it():
    prompts = make_shared_prefix_prompts(48, 192, 16, seed=3)
    assert len(prompts) == 48 and all(len(p) == 208 for p in prompts)
    assert len({p[:192] for p in prompts}) == 1 and len({p[192:] for p in prompts}) == 48
    assert make_shared_prefix_prompts(48, 192, 16, seed=3) == prompts, "seeded"
    assert make_shared_prefix_prompts(1, 192, 16, seed=4)[0][:192] != prompts[0][:192]


class _FakeCompletions:
    """An aiohttp server streaming one SSE event per token, ``delay_s`` apart, with the usage
    a prefix-caching server reports."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.seen: list[dict[str, Any]] = []

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        self.seen.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(self.delay_s)
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) // 2},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _serve_fake(fake: _FakeCompletions, client: Any) -> Any:
    """Run ``client(url)`` (a coroutine function) against ``fake`` on one event loop."""
    from aiohttp import web

    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", fake.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await asyncio.to_thread(client, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_cached_tokens_come_from_the_usage_details():
    fake = _FakeCompletions(delay_s=0.0)
    bodies = completion_bodies(["a" * 10, "b" * 20], 3)
    load: LoadResult = _serve_fake(fake, lambda url: closed_loop(url, bodies, 2))
    assert load.errors == 0
    assert load.prompt_tokens == 30 and load.cached_tokens == 5 + 10
    assert LoadResult([], 1.0).cached_tokens is None, "no answer reported any"


def test_arrivals_keep_coming_until_the_closed_loop_is_done():
    fake = _FakeCompletions(delay_s=0.01)
    streams = completion_bodies(["s" * 4] * 2, 20)  # about 0.2 s each

    def arrival(i: int) -> dict[str, Any]:
        return completion_bodies([f"arrival {i}"], 1)[0]

    loop, came = _serve_fake(
        fake, lambda url: closed_loop_with_arrivals(url, streams, 2, arrival, 0.05)
    )
    assert loop.errors == 0 and came.errors == 0 and len(loop.results) == 2
    # One arrival at once, then one every 50 ms while the streams (~200 ms) run.
    assert 2 <= len(came.results) <= 8
    prompts = [b["prompt"] for b in fake.seen if b["prompt"].startswith("arrival")]
    assert prompts == [f"arrival {i}" for i in range(len(came.results))]
    # The loop's task completes a few event-loop turns after its last answer arrives, and an
    # arrival due in between is still sent (the rule is "until the loop is done"): so one
    # arrival may start after the last stream's end, never more (a second is 50 ms later).
    last_stream_end = max(r.t_end for r in loop.results)
    assert sum(r.t_start > last_stream_end for r in came.results) <= 1
