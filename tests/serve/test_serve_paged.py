# The fixtures imported from test_serve_api are these tests' parameters.
# ruff: noqa: F811
"""The paged KV cache end to end: real uvicorn on 127.0.0.1 over the trained tiny model of
:mod:`test_serve_api` (whose fixtures and helpers are reused).

Prefix caching on equals off over many concurrent requests sharing prefixes, greedy and
sampled, and the cache reports its hits; pages come back after cancellations and clients
that leave; a pool sized for two long sequences serves eight at once by preemption, each
answer equal to offline generation; chunked prefill equals whole prompts; nothing compiles
after warm-up. The servers of one pool shape share the module's engine (every shape they
use is one its first warm-up compiled); the preemption server has a pool of its own, so an
engine of its own. A request that can never fit the pool is a 400 naming it (over the fake
engine: the HTTP path, without a model).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from test_serve_api import (  # fixtures (cfg, model, run_dir, server) and helpers
    assert_error,
    cfg,  # noqa: F401
    load_model,
    metric,
    metrics,
    model,  # noqa: F401
    offline,
    parse_sse,
    run_dir,  # noqa: F401
    sched,
    server,  # noqa: F401
    serving,
    wait_until,
)

from jaxlab.config import JaxlabConfig
from jaxlab.serve import ServerThread

GEN, COMP = "/v1/generate", "/v1/completions"
SYSTEMS = [
    "You count. Numbers follow, one per line: ",  # 41 bytes: two full pages of 16
    "the cat sat on the mat; the dog sat on the log; ",
    "jax xla jax xla jax xla jax xla jax xla ",
]


def with_inference(cfg: JaxlabConfig, **fields: Any) -> JaxlabConfig:
    c = cfg.model_copy(deep=True)
    for key, value in fields.items():
        setattr(c.inference, key, value)
    return c


def check_pools(srv: ServerThread) -> None:
    """Every request over: every pool consistent, no page held, every refcount zero."""
    s = sched(srv)
    wait_until(lambda: s.idle)
    for g in s.groups:
        g.pool.check()
        assert g.pool.used == 0
        assert all(g.pool.refcount(p) == 0 for p in range(g.num_pages))
    m = metrics(srv.url)
    assert metric(m, "jaxlab_kv_cache_pages_used") == 0
    assert metric(m, "jaxlab_kv_cache_pages_total") == s.num_pages


def send_all(url: str, bodies: list[dict[str, Any]], path: str = GEN) -> list[dict[str, Any]]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return list(await asyncio.gather(*(client.post(path, json=b) for b in bodies)))

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [r.json() for r in responses]


def shared_prefix_bodies(n: int) -> list[dict[str, Any]]:
    rng = random.Random(33)
    words = ["one", "two", "three", "cat", "mat", "jax"]
    return [
        {
            "prompt": SYSTEMS[i % 3]
            + " ".join(rng.choice(words) for _ in range(rng.randint(1, 5))),
            "max_tokens": rng.choice([3, 8, 12]),
            "temperature": [0.0, 0.9][i % 2],
            "seed": 500 + i,
            "ignore_eos": True,
        }
        for i in range(n)
    ]


@pytest.mark.slow
def test_prefix_caching_on_equals_off_over_64_concurrent_requests(model, cfg):
    """64 concurrent requests over three shared system prompts, greedy and sampled: the
    same tokens with the prefix cache on and off; with it on, most report cached tokens and
    the counters agree. Streams cut after their first event and a client gone while queued
    give their pages back: at the end every refcount is zero and no page is held. Nothing
    compiles after warm-up."""
    bodies = shared_prefix_bodies(64)
    answers = {}
    for caching in (True, False):
        with serving(model, cfg, prefix_caching=caching, max_queue=128) as srv:
            answers[caching] = send_all(srv.url, bodies)
            if caching:
                m = metrics(srv.url)
                hits = metric(m, "jaxlab_prefix_cache_hits_total")
                cached = [a["cached_tokens"] for a in answers[caching]]
                assert hits == sum(cached) > 0
                assert sum(c > 0 for c in cached) >= 32
                assert all(c % 16 == 0 for c in cached)  # whole pages of 16
                assert metric(m, "jaxlab_prefix_cache_queries_total") >= sum(
                    a["prompt_tokens"] for a in answers[caching]
                )
                leave_early(srv)
            else:
                assert all(a["cached_tokens"] == 0 for a in answers[caching])
            check_pools(srv)
            assert model.engine.compiles == sched(srv).compiles_after_warmup
    on, off = answers[True], answers[False]
    assert [a["token_ids"] for a in on] == [a["token_ids"] for a in off]


def leave_early(srv: ServerThread) -> None:
    """Eight streams cut after their first event, and requests cancelled while queued."""
    s = sched(srv)
    body = {"prompt": SYSTEMS[0] + "cut", "max_tokens": 60, "stream": True, "ignore_eos": True}
    for _ in range(8):
        with httpx.stream("POST", srv.url + COMP, json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    s.pause_admission()
    queued = [srv.service.submit(srv.service.request("x" * 40, _sp(20))) for _ in range(3)]
    wait_until(lambda: s.num_waiting >= 3)
    for h in queued:
        h.cancel()
    s.resume_admission()


def _sp(n: int) -> Any:
    from jaxlab.infer.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.slow
def test_a_pool_for_two_long_sequences_serves_eight_by_preemption(model, run_dir, cfg):
    """8 slots over 16 pages of 16 tokens (two sequences of max_len 128): eight concurrent
    requests of 117 tokens each cannot all hold their pages, so the newest are preempted
    and recomputed (their prompts mostly from the prefix cache); every one completes, equal
    to offline generation, and nothing compiles after warm-up. Its own engine (another
    pool shape), with few shapes to compile: one chunk per call."""
    from jaxlab.infer.sampling import SamplingParams

    small = with_inference(cfg, num_pages=16)
    rng = random.Random(5)
    bodies = [
        {
            "prompt": " ".join(rng.choice(["ab", "cd", "ef", "gh"]) for _ in range(14)),
            "max_tokens": 76,
            "temperature": [0.0, 0.8][i % 2],
            "seed": 40 + i,
            "ignore_eos": True,
        }
        for i in range(8)
    ]
    own = load_model(run_dir, small)
    with serving(own, small, slots=8, decode_groups=1, prefill_batch=1) as srv:
        got = send_all(srv.url, bodies)
        s = sched(srv)
        assert s.preemptions > 0
        assert metric(metrics(srv.url), "jaxlab_num_preemptions_total") == s.preemptions
        check_pools(srv)
        assert own.engine.compiles == s.compiles_after_warmup
    want = offline(
        model,
        [
            (
                b["prompt"],
                SamplingParams(
                    max_new_tokens=b["max_tokens"],
                    temperature=b["temperature"],
                    seed=b["seed"],
                    ignore_eos=True,
                ),
            )
            for b in bodies
        ],
    )
    assert [g["token_ids"] for g in got] == [w.token_ids for w in want]
    assert all(len(g["token_ids"]) == 76 for g in got)
    assert all(len(b["prompt"]) == 41 for b in bodies)  # 41 + 76 = 117 tokens, 8 pages


@pytest.mark.slow
def test_chunked_prefill_equals_whole_prompts(model, cfg):
    """Long prompts prefilled 8 or 32 tokens a step (split over many steps, between decode
    chunks) give the same tokens as whole prompts (offline generation)."""
    from jaxlab.infer.sampling import SamplingParams

    rng = random.Random(9)
    bodies = [
        {
            "prompt": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 90))),
            "max_tokens": 10,
            "temperature": [0.0, 1.0][i % 2],
            "seed": i,
            "ignore_eos": True,
        }
        for i in range(8)
    ]
    got = {}
    for chunk in (8, 32):
        with serving(model, cfg, prefill_chunk_tokens=chunk, prefix_caching=False) as srv:
            got[chunk] = [a["token_ids"] for a in send_all(srv.url, bodies)]
            check_pools(srv)
            assert model.engine.compiles == sched(srv).compiles_after_warmup
    sp = [
        SamplingParams(
            max_new_tokens=10, temperature=b["temperature"], seed=b["seed"], ignore_eos=True
        )
        for b in bodies
    ]
    want = offline(model, [(b["prompt"], p) for b, p in zip(bodies, sp, strict=True)])
    assert got[8] == got[32] == [w.token_ids for w in want]


def test_a_request_that_can_never_fit_the_pool_is_a_400_naming_it():
    """Over the fake engine (pages of 4 tokens), 4 pages over 2 slot groups: a group holds
    8 tokens. 6 + 3 can never fit: a 400 on both endpoints before it queues, naming the
    pool; 6 + 2 fits and runs."""
    from fake_engine import FakeEngine

    from jaxlab.config import load_config
    from jaxlab.serve import ModelService
    from jaxlab.tokenizer import byte_tokenizer

    small = load_config("tiny", ["serve.slots=2", "serve.decode_groups=2"], environ={})
    engine: Any = FakeEngine(page_size=4, num_pages=4)
    with ServerThread(ModelService.from_engine(engine, byte_tokenizer(), small)) as srv:
        srv.wait_ready()
        body = {"prompt": "y" * 6, "max_tokens": 3}
        for path in (GEN, COMP):
            r = httpx.post(srv.url + path, json=body)
            err = assert_error(r, 400, "context_length_exceeded")
            assert err["param"] == "prompt"
            assert "a slot group's pool holds (2: 4 pages over 2 slot groups" in err["message"]
            assert "inference.num_pages" in err["message"]
        assert sched(srv).num_waiting == 0
        ok = httpx.post(srv.url + GEN, json={**body, "max_tokens": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert metric(metrics(srv.url), "jaxlab_requests_total", status="400") == 2


def test_cached_tokens_are_reported_in_every_usage(server):
    """The same 40-token prompt twice on the module's server (prefix caching on by
    default): the second reuses two full pages, and says so in the native answer, the
    completion's usage and the streamed usage chunk."""
    prompt = "cached? " * 5
    first = httpx.post(server.url + GEN, json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert first.status_code == 200
    native = httpx.post(server.url + GEN, json={"prompt": prompt, "max_tokens": 2}).json()
    assert native["cached_tokens"] == 32 and native["prompt_tokens"] == 40
    plain = httpx.post(server.url + COMP, json={"prompt": prompt, "max_tokens": 2}).json()
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", server.url + COMP, json={**body, "stream_options": {"include_usage": True}}
    ) as r:
        chunks = parse_sse(r.read().decode())
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert chunks[-1]["usage"]["prompt_tokens"] == 40
