"""The server end to end: real uvicorn on 127.0.0.1 (ephemeral ports), a real trained engine.

One engine is loaded per module; every server here shares it (same slots and chunk
length, so they share its compiled executables too). Servers that need other limits
(queue, timeout, body size, API key) are started on it with those settings. Offline
references come from :func:`jaxlab.infer.offline.generate` on engines of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RUN_STEPS, tiny_run_dir
from prometheus_client.parser import text_string_to_metric_families

from jaxlab.config import JaxlabConfig
from jaxlab.serve import (
    ModelService,
    ModelState,
    RequestStream,
    Scheduler,
    ServedModel,
    ServerThread,
    serve_config,
)

OVERRIDES = [
    "inference.prefill_buckets=[32,128]",
    "inference.stream_chunk_tokens=8",
    "serve.slots=4",
    "serve.decode_groups=2",  # two groups of 2 slots on any machine: the threaded path
    "serve.max_tokens_limit=100",
    # Chunks of at most 32 tokens: one length bucket to compile (of each kind), not two.
    "serve.prefill_chunk_tokens=32",
]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def cfg(run_dir: Path) -> JaxlabConfig:
    return serve_config(run_dir, OVERRIDES, environ={})


def load_model(run_dir: Path, cfg: JaxlabConfig) -> ServedModel:
    """The run's latest checkpoint on an engine of its own (its compiles are its own)."""
    from jaxlab.infer.engine import Engine
    from jaxlab.infer.load import load_run

    run = load_run(run_dir, cfg=cfg)
    return ServedModel(Engine(run.graphdef, run.params, run.cfg), run.tokenizer, run.step)


@pytest.fixture(scope="module")
def model(run_dir: Path, cfg: JaxlabConfig) -> ServedModel:
    return load_model(run_dir, cfg)


@pytest.fixture(scope="module")
def engine(model: ServedModel) -> Any:
    return model.engine


def offline(reference: ServedModel, requests: list[Any]) -> Any:
    """``requests`` (``(token ids, SamplingParams)``, or ``(text, SamplingParams)``) as one
    offline batch on ``reference``: :func:`jaxlab.infer.offline.generate`'s results."""
    from jaxlab.infer.offline import generate
    from jaxlab.infer.request import Request

    tok = reference.tokenizer
    limits = reference.engine.limits(tok.eot_id)
    reqs = [
        Request.create(tok.encode(p) if isinstance(p, str) else p, sp, limits) for p, sp in requests
    ]
    return generate(reference.engine, reqs, tokenizer=tok)


def submit(srv: ServerThread, ids: list[int], sampling: Any) -> RequestStream:
    """Queue token ids straight into ``srv``'s service (no HTTP; events on a plain queue)."""
    from jaxlab.infer.request import Request

    svc = srv.service
    assert svc.model is not None
    limits = svc.model.engine.limits(svc.model.tokenizer.eot_id)
    return svc.submit(Request.create(ids, sampling, limits))


def drain_events(h: RequestStream) -> None:
    while h.get(timeout=60).kind == "tokens":
        pass


@contextlib.contextmanager
def serving(
    model: ServedModel,
    cfg: JaxlabConfig,
    *,
    loader: Callable[[], ServedModel] | None = None,
    chunk_delay_s: float = 0.0,
    **serve: Any,
) -> Iterator[ServerThread]:
    """A server on ``model`` with ``serve.*`` fields replaced."""
    c = cfg.model_copy(deep=True)
    for key, value in serve.items():
        setattr(c.serve, key, value)
    svc = ModelService(c, loader or (lambda: model))
    svc.chunk_delay_s = chunk_delay_s
    srv = ServerThread(svc).start()
    try:
        if loader is None:
            srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(model: ServedModel, cfg: JaxlabConfig) -> Iterator[ServerThread]:
    with serving(model, cfg) as srv:
        yield srv


def sched(srv: ServerThread) -> Scheduler:
    assert srv.service.scheduler is not None
    return srv.service.scheduler


def metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def metric(m: dict, name: str, **labels: str) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    t_end = time.perf_counter() + timeout_s
    while not pred():
        if time.perf_counter() > t_end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def parse_sse(raw: str) -> list[dict]:
    """Strict SSE framing: ``data: `` lines, blank-line separated, ``[DONE]`` last."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    payloads = []
    for block in blocks[:-1]:
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), block
        payloads.append(lines[0].removeprefix("data: "))
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def stream_text(chunks: list[dict]) -> tuple[str, str | None]:
    for c in chunks[:-1]:
        assert c["choices"][0]["finish_reason"] is None
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0][
        "finish_reason"
    ]


# ----------------------------------------------------------------------------- correctness


def mixed_requests(n: int = 32) -> list[dict[str, Any]]:
    rng = random.Random(1234)
    words = ["the", "cat", "sat", "on", "a", "mat;", "count", "one", "two", "jax", "xla"]
    reqs = []
    for i in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 4, 9, 16])))
        room = 127 - len(prompt.encode())
        reqs.append(
            {
                "prompt": prompt,
                "max_tokens": min(rng.choice([1, 3, 8, 17, 40, 64]), room, 100),
                "temperature": [0.0, 0.7, 1.0, 1.4][i % 4],
                "top_k": [0, 0, 20, 0][i % 4],
                "top_p": [1.0, 1.0, 1.0, 0.9][i % 4],
                "seed": 1000 + i,
            }
        )
    assert len({len(r["prompt"].encode()) > 32 for r in reqs}) == 2, "both buckets"
    return reqs


@pytest.mark.slow
def test_32_concurrent_requests_equal_offline_generate(server, run_dir, cfg):
    from jaxlab.infer.sampling import SamplingParams

    reqs = mixed_requests()

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/generate", json=r) for r in reqs))

    chunks_before = sched(server).chunks
    responses = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    answers = [r.json() for r in responses]

    # The reference: a separate engine, all 32 prompts as one offline batch.
    expected = offline(
        load_model(run_dir, cfg),
        [
            (
                r["prompt"],
                SamplingParams(
                    max_new_tokens=r["max_tokens"],
                    temperature=r["temperature"],
                    top_k=r["top_k"],
                    top_p=r["top_p"],
                    seed=r["seed"],
                ),
            )
            for r in reqs
        ],
    )
    for req, got, want in zip(reqs, answers, expected, strict=True):
        assert got["token_ids"] == want.token_ids, req
        assert got["text"] == want.text
        assert got["finish_reason"] == want.finish_reason
        assert got["generated_tokens"] == len(want.token_ids)
        assert got["prompt_tokens"] == len(req["prompt"].encode())
        assert got["seed"] == req["seed"]
        assert got["model"] == "jaxlab" and got["checkpoint_step"] == RUN_STEPS
        assert got["platform"] == "cpu" and got["precision"] == "float32"
        for key in ("prefill_s", "decode_s", "total_s", "ttft_s", "queue_s", "tokens_per_s"):
            assert got[key] >= 0
        assert got["ttft_s"] <= got["total_s"]
    # They shared the batch: 32 requests of up to 64 tokens in far fewer chunks than alone.
    chunks = sched(server).chunks - chunks_before
    alone = sum(-(-max(r["max_tokens"] - 1, 0) // 8) for r in reqs)
    assert chunks < alone
    assert sched(server).idle


@pytest.mark.slow
def test_one_slot_group_serves_the_same_tokens(server, run_dir, cfg):
    """``serve.decode_groups=1`` (one batched state, the scheduler's plain path) answers
    the same tokens as the module's two-group server. Its own engine: a 4-row decode
    state is another compile, which must not count against the module server's engine."""
    reqs = mixed_requests(12)
    one = cfg.model_copy(deep=True)
    one.serve.decode_groups = 1

    async def send_all(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            rs = await asyncio.gather(*(client.post("/v1/generate", json=r) for r in reqs))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json() for r in rs]

    with serving(load_model(run_dir, cfg), one) as srv:
        assert [list(g.slots) for g in sched(srv).groups] == [[0, 1, 2, 3]]
        assert srv.service.info()["decode_groups"] == 1
        assert metric(metrics(srv.url), "jaxlab_decode_groups") == 1
        single = asyncio.run(send_all(srv.url))
    grouped = asyncio.run(send_all(server.url))
    assert [r["token_ids"] for r in single] == [r["token_ids"] for r in grouped]
    assert server.service.info()["decode_groups"] == 2
    assert metric(metrics(server.url), "jaxlab_decode_groups") == 2


def test_output_does_not_depend_on_the_rest_of_the_batch(server):
    req = {"prompt": "the cat", "max_tokens": 30, "temperature": 1.0, "seed": 7}
    alone = httpx.post(server.url + "/v1/generate", json=req).json()["token_ids"]

    async def crowded() -> list[dict]:
        others = [
            {
                "prompt": "count one two " * (i % 3 + 1),
                "max_tokens": 40,
                "temperature": 0.9,
                "seed": i,
            }
            for i in range(7)
        ]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            rs = await asyncio.gather(
                *(client.post("/v1/generate", json=r) for r in [*others[:3], req, *others[3:]])
            )
        return [r.json() for r in rs]

    assert asyncio.run(crowded())[3]["token_ids"] == alone


def test_streaming_equals_non_streaming_with_valid_sse(server):
    prompts = [
        ("the cat sat", {"temperature": 0.0, "max_tokens": 40}),
        ("count: one two", {"temperature": 0.9, "seed": 3, "max_tokens": 50}),
        ("héllo wörld ✓", {"temperature": 1.2, "seed": 11, "max_tokens": 64, "top_k": 30}),
        ("x", {"temperature": 0.0, "max_tokens": 1}),
    ]
    for prompt, params in prompts:
        body = {"model": "jaxlab", "prompt": prompt, **params}
        plain = httpx.post(server.url + "/v1/completions", json=body).json()
        assert plain["object"] == "text_completion" and plain["model"] == "jaxlab"
        choice = plain["choices"][0]
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
        chunks = parse_sse(raw)
        usage = chunks.pop()
        assert usage["choices"] == []
        # The same prompt again: its full pages may come from the prefix cache now.
        details = usage["usage"].pop("prompt_tokens_details")
        assert (
            details["cached_tokens"] >= plain["usage"].pop("prompt_tokens_details")["cached_tokens"]
        )
        assert usage["usage"] == plain["usage"]
        text, finish = stream_text(chunks)
        assert text == choice["text"]
        assert finish == choice["finish_reason"]
        assert {c["id"] for c in chunks} == {chunks[0]["id"]}
        native = httpx.post(server.url + "/v1/generate", json={"prompt": prompt, **params}).json()
        assert native["text"] == text
        assert plain["usage"]["completion_tokens"] == native["generated_tokens"]
        assert plain["usage"]["prompt_tokens"] == native["prompt_tokens"]


def test_stop_strings_truncate_text_streaming_and_not(server):
    base = {"prompt": "the cat sat on", "max_tokens": 60, "temperature": 0.0}
    full = httpx.post(server.url + "/v1/generate", json=base).json()["text"]
    assert len(full) > 20
    stop = full[10:13]
    cut = full[: full.index(stop)]
    for body in ({**base, "stop": stop}, {**base, "stop": ["\x00never", stop]}):
        native = httpx.post(server.url + "/v1/generate", json=body).json()
        assert native["text"] == cut and native["finish_reason"] == "stop"
        plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
        assert plain["text"] == cut and plain["finish_reason"] == "stop"
        with httpx.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}
        ) as r:
            text, finish = stream_text(parse_sse(r.read().decode()))
        assert (text, finish) == (cut, "stop")
    assert sched(server).idle


# ----------------------------------------------------------------------------- metrics


def test_metrics_parse_and_count_requests_by_status(server):
    before = metrics(server.url)
    url = server.url
    ok = [
        httpx.post(url + "/v1/generate", json={"prompt": "abc", "max_tokens": 5, "seed": 1}),
        httpx.post(url + "/v1/generate", json={"prompt": "hello there", "max_tokens": 9}),
        httpx.post(url + "/v1/completions", json={"prompt": "zz", "max_tokens": 4}),
    ]
    with httpx.stream(
        "POST", url + "/v1/completions", json={"prompt": "qq", "max_tokens": 6, "stream": True}
    ) as r:
        r.read()
    bad = [
        httpx.post(url + "/v1/generate", content=b"{oops"),
        httpx.post(url + "/v1/generate", json={"prompt": "x", "nope": 1}),
        httpx.post(url + "/v1/generate", json={"prompt": "x" * 300}),
    ]
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.status_code for r in bad] == [400, 422, 400]
    after = metrics(url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("jaxlab_requests_total", status="200") == 4
    assert delta("jaxlab_requests_total", status="400") == 2
    assert delta("jaxlab_requests_total", status="422") == 1
    assert (
        sum(
            v - metric(before, k[0], **dict(k[1]))
            for k, v in after.items()
            if k[0] == "jaxlab_requests_total"
        )
        == 7
    )
    for hist in (
        "jaxlab_e2e_request_latency_seconds",
        "jaxlab_time_to_first_token_seconds",
        "jaxlab_request_queue_time_seconds",
    ):
        assert delta(hist + "_count") == 4, hist
    assert delta("jaxlab_time_per_output_token_seconds_count") >= 3  # the 1-token ones do not count
    generated = [r.json()["generated_tokens"] for r in ok[:2]]
    generated.append(ok[2].json()["usage"]["completion_tokens"])
    assert delta("jaxlab_generation_tokens_total") >= sum(generated)
    assert delta("jaxlab_prompt_tokens_total") == 3 + 11 + 2 + 2
    assert metric(after, "jaxlab_num_requests_running") == 0
    assert metric(after, "jaxlab_num_requests_waiting") == 0
    assert metric(after, "jaxlab_kv_cache_usage_ratio") == 0
    assert metric(after, "jaxlab_model_state", state="ready") == 1
    assert metric(after, "jaxlab_model_state", state="loading") == 0
    compiles = server.service.engine.compiles
    for fn, n in compiles.items():
        assert metric(after, "jaxlab_compilations_total", function=fn) == n


# ----------------------------------------------------------------------------- bad input


def test_error_paths_are_openai_shaped_and_never_500(server):
    url = server.url
    post = httpx.post
    gen, comp = url + "/v1/generate", url + "/v1/completions"
    assert_error(post(gen, content=b"{not json"), 400, "invalid_json")
    assert_error(post(gen, json=[1, 2]), 400, "invalid_json")
    assert assert_error(post(gen, json={"prompt": 5}), 422)["param"] == "prompt"
    assert assert_error(post(gen, json={}), 422, "missing")["param"] == "prompt"
    assert_error(post(gen, json={"prompt": "x", "max_tokens": 0}), 400, "invalid_value")
    assert_error(post(gen, json={"prompt": "x", "temperature": "hot"}), 422)
    assert_error(post(gen, json={"prompt": "x", "top_p": 0}), 400, "invalid_value")
    assert_error(post(gen, json={"prompt": "x", "tempreature": 1}), 422, "unknown_field")
    assert_error(post(gen, json={"prompt": ""}), 400)
    err = assert_error(post(gen, json={"prompt": "x" * 200}), 400, "context_length_exceeded")
    assert "inference.max_len = 128" in err["message"]
    err = assert_error(post(gen, json={"prompt": "x", "max_tokens": 101}), 400)
    assert "serve.max_tokens_limit = 100" in err["message"] and err["param"] == "max_tokens"
    assert_error(post(comp, json={"model": "gpt-4", "prompt": "x"}), 404, "model_not_found")
    assert_error(post(comp, json={"prompt": "x", "n": 2}), 400, "unsupported")
    assert_error(post(comp, json={"prompt": ["a", "b"]}), 400, "unsupported")
    assert_error(post(comp, json={"prompt": "x", "stop": ""}), 400)
    assert_error(post(comp, json={"prompt": "x", "stream": True, "max_tokens": 500}), 400)
    assert_error(httpx.get(gen), 405)
    assert_error(httpx.get(url + "/v1/nothing"), 404)
    assert_error(httpx.get(url + "/nothing"), 404)
    m = metrics(url)
    assert not any(
        k[0] == "jaxlab_requests_total" and dict(k[1])["status"].startswith("5") and v
        for k, v in m.items()
    )


def test_chat_on_a_tokenizer_without_chat_tokens_is_400_naming_the_fix(server):
    # This run's byte tokenizer was trained without the chat tokens.
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "jaxlab", "messages": [{"role": "user", "content": "hi"}]},
    )
    err = assert_error(r, 400, "chat_template_unavailable")
    assert err["param"] == "model" and "tokenizer.chat_tokens = true" in err["message"]
    assert "/v1/completions" in err["message"] or "completions" in err["message"]


def test_a_ready_server_has_frozen_its_startup_heap_and_thaws_it_on_stop(model, cfg):
    """A full collection skips what the server built before ``ready`` (see
    ``jaxlab.serve.service._freeze_startup_heap``), and stopping gives the freeze back."""
    from jaxlab.serve import service

    before = service._frozen_services
    with serving(model, cfg) as srv:
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() > 0
        assert id(sched(srv)) not in tracked and id(srv.service) not in tracked
        assert service._frozen_services == before + 1
    assert service._frozen_services == before


def test_a_bug_is_still_a_json_500(model, cfg, monkeypatch):
    with serving(model, cfg) as srv:

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        monkeypatch.setattr(srv.service, "submit", broken)
        err = assert_error(
            httpx.post(srv.url + "/v1/generate", json={"prompt": "x", "max_tokens": 2}),
            500,
            "internal_error",
        )
        assert "RuntimeError" in err["message"]
        assert metric(metrics(srv.url), "jaxlab_requests_total", status="500") == 1


def test_body_over_max_body_bytes_is_413(model, cfg):
    with serving(model, cfg, max_body_bytes=200) as srv:
        body = json.dumps({"prompt": "y" * 300}).encode()
        err = assert_error(httpx.post(srv.url + "/v1/generate", content=body), 413)
        assert "serve.max_body_bytes = 200" in err["message"]

        def chunked() -> Iterator[bytes]:  # no Content-Length: the bytes read are counted
            for i in range(0, len(body), 50):
                yield body[i : i + 50]

        assert_error(httpx.post(srv.url + "/v1/completions", content=chunked()), 413)
        ok = httpx.post(srv.url + "/v1/generate", json={"prompt": "y" * 50, "max_tokens": 2})
        assert ok.status_code == 200
        m = metrics(srv.url)
        assert metric(m, "jaxlab_requests_total", status="413") == 2


def test_api_key_guards_v1_and_the_openai_client_works(model, cfg):
    import openai
    from pydantic import SecretStr

    with serving(model, cfg, api_key=SecretStr("sekrit")) as srv:
        assert_error(httpx.get(srv.url + "/v1/models"), 401, "invalid_api_key")
        assert_error(
            httpx.post(
                srv.url + "/v1/generate",
                json={"prompt": "x"},
                headers={"Authorization": "Bearer no"},
            ),
            401,
        )
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/ready").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        auth = {"Authorization": "Bearer sekrit"}
        native = httpx.post(
            srv.url + "/v1/generate",
            json={
                "prompt": "the cat",
                "max_tokens": 24,
                "temperature": 0.8,
                "seed": 5,
                "top_k": 40,
            },
            headers=auth,
        ).json()

        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in client.models.list()] == ["jaxlab"]
        params: dict[str, Any] = {
            "model": "jaxlab",
            "prompt": "the cat",
            "max_tokens": 24,
            "temperature": 0.8,
            "seed": 5,
            "extra_body": {"top_k": 40},
        }
        done = client.completions.create(**params)
        assert done.choices[0].text == native["text"]
        assert done.choices[0].finish_reason == native["finish_reason"]
        assert done.usage is not None and done.usage.completion_tokens == native["generated_tokens"]
        pieces = list(client.completions.create(**params, stream=True))
        assert "".join(c.choices[0].text for c in pieces if c.choices) == native["text"]
        stopped = client.completions.create(**{**params, "stop": [native["text"][5:8]]})
        assert (
            stopped.choices[0].text == native["text"][: native["text"].index(native["text"][5:8])]
        )
        assert stopped.choices[0].finish_reason == "stop"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="jaxlab", prompt="x", max_tokens=1000)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x")


# ----------------------------------------------------------------------------- faults


def test_queue_full_is_503_with_retry_after(model, cfg):
    with serving(model, cfg, max_queue=2) as srv:
        sc = sched(srv)
        sc.pause_admission()

        async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                queued = [
                    asyncio.ensure_future(
                        client.post("/v1/generate", json={"prompt": f"q{i}", "max_tokens": 4})
                    )
                    for i in range(2)
                ]
                while sc.num_waiting < 2:
                    await asyncio.sleep(0.01)
                full = await client.post("/v1/generate", json={"prompt": "late", "max_tokens": 4})
                assert metric(metrics(srv.url), "jaxlab_num_requests_waiting") == 2
                sc.resume_admission()
                return list(await asyncio.gather(*queued)), full

        queued, full = asyncio.run(scenario())
        assert_error(full, 503, "queue_full")
        assert int(full.headers["Retry-After"]) >= 1
        assert [r.status_code for r in queued] == [200, 200]


def test_request_timeout_is_504_and_frees_the_slot(model, cfg):
    with serving(model, cfg, request_timeout_s=1.0, chunk_delay_s=0.4) as srv:
        url = srv.url
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/generate", json={"prompt": "slow", "max_tokens": 64})
        assert_error(r, 504, "timeout")
        assert time.perf_counter() - t0 < 5
        wait_until(lambda: metric(metrics(url), "jaxlab_num_requests_running") == 0)
        # Streaming: the 200 header went out with the first token; the error is an event.
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": "slow", "max_tokens": 64, "stream": True},
        ) as s:
            assert s.status_code == 200
            payloads = [
                json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")
            ]
        assert payloads[-1]["error"]["code"] == "timeout"
        # Timed out while still queued: a real 504.
        sched(srv).pause_admission()
        assert_error(httpx.post(url + "/v1/generate", json={"prompt": "q", "max_tokens": 2}), 504)
        sched(srv).resume_admission()
        # Short requests still work, and the slots are free.
        assert (
            httpx.post(url + "/v1/generate", json={"prompt": "ok", "max_tokens": 1}).status_code
            == 200
        )
        m = metrics(url)
        assert metric(m, "jaxlab_requests_total", status="504") == 3
        assert metric(m, "jaxlab_num_requests_running") == 0


def test_client_disconnect_cancels_and_frees_the_slot(model, cfg):
    with serving(model, cfg, chunk_delay_s=0.2) as srv:
        url = srv.url
        body = {"prompt": "bye", "max_tokens": 80, "stream": True}
        with (
            httpx.Client(base_url=url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as s,
        ):
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            assert metric(metrics(url), "jaxlab_num_requests_running") == 1
        # leaving the block closed the connection mid-stream
        wait_until(lambda: metric(metrics(url), "jaxlab_num_requests_running") == 0)
        assert sched(srv).idle
        # Non-streaming: the client gives up waiting.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/generate", json={"prompt": "bye", "max_tokens": 80}, timeout=0.5)
        wait_until(lambda: sched(srv).idle)
        # The gauges are set after the engine thread's step that freed the slot.
        wait_until(lambda: metric(metrics(url), "jaxlab_num_requests_running") == 0)
        m = metrics(url)
        assert metric(m, "jaxlab_kv_cache_pages_used") == 0  # its pages came back too
        assert metric(m, "jaxlab_requests_total", status="499") == 2
        assert metric(m, "jaxlab_e2e_request_latency_seconds_count") == 0  # none finished


# ----------------------------------------------------------------------------- lifecycle


def test_ready_is_503_until_loaded_and_warmed(model, cfg):
    gate = threading.Event()

    def slow_loader() -> ServedModel:
        gate.wait(60)
        return model

    with serving(model, cfg, loader=slow_loader) as srv:
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["state"] == "loading"
        assert httpx.get(srv.url + "/health").json() == {"status": "ok", "state": "loading"}
        err = assert_error(httpx.post(srv.url + "/v1/generate", json={"prompt": "x"}), 503)
        assert err["code"] == "not_ready"
        assert metric(metrics(srv.url), "jaxlab_model_state", state="loading") == 1
        gate.set()
        srv.wait_ready()
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 200 and r.json()["ready"] is True
        states = [s for s, _ in srv.service.lifecycle.history]
        assert states == [
            ModelState.EMPTY,
            ModelState.LOADING,
            ModelState.WARMING,
            ModelState.READY,
        ]
        assert (
            httpx.post(srv.url + "/v1/generate", json={"prompt": "x", "max_tokens": 2}).status_code
            == 200
        )


def test_a_stop_during_warm_up_ends_it_before_the_next_compile(run_dir, cfg):
    # A fresh engine (nothing compiled yet), and a drain requested the moment warm-up
    # starts, from the engine thread itself (lifecycle listeners run synchronously): the
    # warm-up must stop before its first compile instead of compiling every bucket.
    loaded = load_model(run_dir, cfg)
    fresh = loaded.engine
    svc = ModelService(cfg, lambda: loaded)

    def stop_at_warm_up(old: ModelState, new: ModelState) -> None:
        if new == ModelState.WARMING:
            svc.begin_drain()

    svc.lifecycle.add_listener(stop_at_warm_up)
    svc.start()
    assert svc.lifecycle.wait_for({ModelState.STOPPED}, 60) == ModelState.STOPPED
    svc.stop()
    assert [s for s, _ in svc.lifecycle.history][-2:] == [ModelState.WARMING, ModelState.STOPPED]
    assert sum(fresh.compiles.values()) == 0, fresh.compiles
    assert svc.scheduler is None  # never usable: requests get 503 not_ready


def test_a_model_that_fails_to_load_reports_failed(model, cfg):
    def broken_loader() -> Any:
        raise FileNotFoundError("no checkpoint here")

    with serving(model, cfg, loader=broken_loader) as srv:
        assert srv.service.wait_ready(30) == ModelState.FAILED
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["state"] == "failed"
        assert "no checkpoint here" in r.json()["error"]
        assert httpx.get(srv.url + "/health").status_code == 200
        assert_error(httpx.post(srv.url + "/v1/generate", json={"prompt": "x"}), 503, "not_ready")
        assert metric(metrics(srv.url), "jaxlab_model_state", state="failed") == 1


def test_drain_finishes_in_flight_and_refuses_new_requests(model, cfg):
    with serving(model, cfg, chunk_delay_s=0.25) as srv:
        url = srv.url
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"prompt": "drain me", "max_tokens": 64, "stream": True},
        ) as s:
            lines = s.iter_lines()
            first = next(lines)
            srv.server.request_drain()
            wait_until(lambda: srv.service.state == ModelState.DRAINING)
            assert httpx.get(url + "/ready").status_code == 503
            late = httpx.post(url + "/v1/generate", json={"prompt": "late"})
            assert_error(late, 503, "draining")
            assert "Retry-After" in late.headers
            raw = "\n".join([first, *lines]) + "\n"
        _, finish = stream_text(parse_sse(raw))
        assert finish == "length"
        assert srv.wait_exit(30)
        states = [s for s, _ in srv.service.lifecycle.history]
        assert states[-2:] == [ModelState.DRAINING, ModelState.STOPPED]


def real_chunks(srv: ServerThread, chunks: Any) -> list[Any]:
    """The chunks of a prefill call that are not padding (a padding row has no page)."""
    no_page = sched(srv).groups[0].no_page
    return [c for c in chunks if any(p != no_page for p in c.pages)]


def admit_together(srv: ServerThread, engine: Any, run_dir: Any, cfg: Any, reqs: list) -> tuple:
    """Queue ``reqs`` while admission is paused, release them at once and drain them.

    Returns ``(outputs, expected, prefills)``: each request's served tokens, its offline
    generation (a separate engine, whose compiles are its own), and the chunk lengths of
    every ``prefill`` call the scheduler made (padding rows left out), in order.
    """
    s = sched(srv)
    wait_until(lambda: s.idle)
    reference = load_model(run_dir, cfg)
    expected = [offline(reference, [(ids, sp)])[0].token_ids for ids, sp in reqs]
    prefills: list[list[int]] = []
    prefill = engine.prefill

    def counting(state: Any, chunks: Any) -> Any:
        prefills.append([len(c.tokens) for c in real_chunks(srv, chunks)])
        return prefill(state, chunks)

    s.pause_admission()
    engine.prefill = counting
    try:
        handles = [submit(srv, list(ids), sp) for ids, sp in reqs]
        s.resume_admission()
        for h in handles:
            drain_events(h)
    finally:
        del engine.prefill
        s.resume_admission()
    return [h.token_ids for h in handles], expected, prefills


def test_requests_admitted_together_share_a_prefill_per_group_and_equal_offline(
    server, engine, run_dir, cfg
):
    """With every slot free, waiting requests spread over the two slot groups and each
    group prefills its own as one ragged call, within its own budget (one finishes in
    prefill and gives its slot to the fifth); each output equals generating it alone, and
    nothing compiles beyond the warm-up."""
    from jaxlab.infer.sampling import SamplingParams

    s = sched(server)
    assert s.prefill_batch == 4 == s.slots
    reqs = [
        ([7] * 3, SamplingParams(max_new_tokens=9, ignore_eos=True)),
        ([9] * 25, SamplingParams(max_new_tokens=5, temperature=0.9, seed=4, ignore_eos=True)),
        ([11] * 2, SamplingParams(max_new_tokens=1, ignore_eos=True)),  # done in prefill
        ([13] * 12, SamplingParams(max_new_tokens=7, top_k=5, temperature=1.0, seed=1)),
        ([15] * 4, SamplingParams(max_new_tokens=6, ignore_eos=True)),  # waits for a slot
    ]
    outputs, expected, prefills = admit_together(server, engine, run_dir, cfg, reqs)
    assert outputs == expected
    # Slots 0, 2, 1, 3 in turn; each group's 32 tokens of the step: [3, 2] in group 0,
    # [25, 7] in group 1 (the 12-token prompt is cut). The one done in prefill frees slot 1
    # for the last, and the next step prefills the rest of the 12 and the last one.
    assert prefills == [[3, 2], [25, 7], [5], [4]]
    assert engine.compiles == s.compiles_after_warmup


def test_a_long_prompt_is_prefilled_in_chunks_packed_with_short_ones(server, engine, run_dir, cfg):
    """serve.prefill_chunk_tokens = 32: a 100-token prompt is prefilled 32 tokens a step,
    oldest first, and its last 4 are packed with the short prompt of its slot group in the
    rest of the group's budget; the other group spends its own budget meanwhile. Each output equals offline
    generation."""
    from jaxlab.infer.sampling import SamplingParams

    s = sched(server)
    assert s.admission_sizes == (4, 2, 1) and s.prefill_chunk_tokens == 32
    reqs = [
        ([21] * 100, SamplingParams(max_new_tokens=6, ignore_eos=True)),
        ([22] * 5, SamplingParams(max_new_tokens=8, temperature=0.7, seed=9, ignore_eos=True)),
        ([23] * 9, SamplingParams(max_new_tokens=4, ignore_eos=True)),
    ]
    outputs, expected, prefills = admit_together(server, engine, run_dir, cfg, reqs)
    assert outputs == expected
    # Slots 0 (group 0), 2 (group 1), 1 (group 0): the 100-token prompt gets group 0's
    # whole budget three steps running while group 1 prefills the 5-token one in the first;
    # the fourth step, its last 4 with the 9-token one.
    assert prefills == [[32], [5], [32], [32], [4, 9]]
    assert engine.compiles == s.compiles_after_warmup


def test_requests_spread_over_the_slot_groups_which_decode_side_by_side(
    server, engine, run_dir, cfg
):
    """``serve.decode_groups=2``: slots 0-1 and 2-3 are two batched states, each over a
    page pool of its own. Requests admitted together take the least busy group's lowest
    free slot, so three of them land in slots 0, 2 and 1 (one prefill and one ``insert``
    per group, with the group's own row indices); every chunk then runs both groups, each
    dispatched from its own thread; and each output equals offline generation."""
    from jaxlab.infer.sampling import SamplingParams

    s = sched(server)
    assert [list(g.slots) for g in s.groups] == [[0, 1], [2, 3]]
    reqs = [
        ([51] * 4, SamplingParams(max_new_tokens=20, ignore_eos=True)),
        ([52] * 7, SamplingParams(max_new_tokens=17, temperature=0.8, seed=2, ignore_eos=True)),
        ([53] * 3, SamplingParams(max_new_tokens=23, ignore_eos=True)),
    ]
    inserts: list[tuple[int, list[int]]] = []
    chunks: list[tuple[int, str]] = []
    insert, generate = engine.insert, engine.generate

    def record_insert(pre: Any, state: Any, slots: Any) -> Any:
        inserts.append((state.slots, list(slots)))
        return insert(pre, state, slots)

    def record_chunk(state: Any, *args: Any, **kwargs: Any) -> Any:
        chunks.append((state.slots, threading.current_thread().name))
        return generate(state, *args, **kwargs)

    engine.insert, engine.generate = record_insert, record_chunk
    try:
        outputs, expected, prefills = admit_together(server, engine, run_dir, cfg, reqs)
    finally:
        del engine.insert, engine.generate
    assert outputs == expected
    assert prefills == [[4, 3], [7]]
    assert inserts == [(2, [0, 1]), (2, [0])]
    assert {rows for rows, _ in chunks} == {2}
    threads = {name for _, name in chunks}
    assert threads == {"jaxlab-decode-0_0", "jaxlab-decode-1_0"}, threads
    assert engine.compiles == s.compiles_after_warmup


def test_requests_arriving_during_a_prefill_are_admitted_before_the_next_chunk(
    server, engine, run_dir, cfg
):
    """Prefill goes first: two requests that arrive while the first is being prefilled
    (submitted from inside its prefill) are prefilled before any decode chunk runs, so
    all three decode together from their first chunk, each equal to offline generation."""
    from jaxlab.infer.sampling import SamplingParams

    s = sched(server)
    wait_until(lambda: s.idle)
    first = ([31] * 6, SamplingParams(max_new_tokens=12, ignore_eos=True))
    later = [
        ([32] * 9, SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True)),
        ([33] * 4, SamplingParams(max_new_tokens=11, ignore_eos=True)),
    ]
    reference = load_model(run_dir, cfg)
    expected = [offline(reference, [(ids, sp)])[0].token_ids for ids, sp in [first, *later]]
    calls: list[str] = []
    late_handles: list[Any] = []
    prefill_fn, generate_fn = engine.prefill, engine.generate

    def prefill(state: Any, chunks: Any) -> Any:
        calls.append(f"prefill {len(real_chunks(server, chunks))}")
        if not late_handles:  # the others arrive while this one is being prefilled
            late_handles.extend(submit(server, list(ids), sp) for ids, sp in later)
        return prefill_fn(state, chunks)

    def chunk(*args: Any, **kwargs: Any) -> Any:
        calls.append("chunk")
        return generate_fn(*args, **kwargs)

    engine.prefill, engine.generate = prefill, chunk
    try:
        handles = [submit(server, list(first[0]), first[1])]
        wait_until(lambda: len(late_handles) == 2)
        handles += late_handles
        for h in handles:
            drain_events(h)
    finally:
        del engine.prefill, engine.generate
    # The late ones land in slots 2 and 1: one prefill in each group.
    assert calls[:3] == ["prefill 1", "prefill 1", "prefill 1"], calls
    assert "prefill" not in " ".join(calls[3:]), calls
    assert [h.token_ids for h in handles] == expected
    assert engine.compiles == s.compiles_after_warmup


def test_requests_done_in_prefill_cannot_starve_decoding(server, engine):
    """Prefill goes first, but boundedly: one-token requests (done in prefill, their slot
    is free again at once) that keep arriving during each other's prefills are admitted at
    most ``slots`` per iteration, so the request that is decoding still advances between
    them."""
    from jaxlab.infer.sampling import SamplingParams

    s = sched(server)
    wait_until(lambda: s.idle)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    calls: list[str] = []
    flood: list[Any] = []
    prefill_fn, generate_fn = engine.prefill, engine.generate

    def prefill(state: Any, chunks: Any) -> Any:
        calls.append("prefill")
        if calls.count("chunk") and len(flood) < 12:  # the next one arrives meanwhile
            flood.append(submit(server, [41] * 3, one))
        return prefill_fn(state, chunks)

    def chunk(*args: Any, **kwargs: Any) -> Any:
        calls.append("chunk")
        if len(flood) == 0:
            flood.append(submit(server, [41] * 3, one))
        return generate_fn(*args, **kwargs)

    engine.prefill, engine.generate = prefill, chunk
    try:
        long = submit(server, [40] * 5, SamplingParams(max_new_tokens=90, ignore_eos=True))
        drain_events(long)
        wait_until(lambda: len(flood) == 12 and all(h.finished for h in flood))
    finally:
        del engine.prefill, engine.generate
    assert all(h.finish_reason == "length" and len(h.token_ids) == 1 for h in flood)
    runs = "".join("p" if c == "prefill" else "c" for c in calls).split("c")
    assert max(len(r) for r in runs) <= s.slots, calls
    assert len(long.token_ids) == 90


def test_load_generator_counts_tokens_and_sorts_failures(server):
    """``jaxlab bench serve``'s client against the real server: the good requests' token
    counts come from ``usage``, their stream events are timed, and a refused request is
    counted as an error under its status (not raised, not dropped)."""
    from jaxlab.serve.loadgen import closed_loop, completion_bodies, make_prompts

    bodies = completion_bodies(make_prompts(6, 8, seed=3), 12, temperature=0.0)
    bodies[2] = {**bodies[2], "max_tokens": 1000}  # over serve.max_tokens_limit: 400
    load = closed_loop(server.url, bodies, concurrency=3)
    assert load.errors == 1 and load.error_summary() == {"400": 1}
    bad = load.results[[r.status for r in load.results].index(400)]
    assert not bad.ok and "max_tokens" in (bad.error or "")
    assert len(load.ok) == 5 and load.output_tokens == 5 * 12
    for r in load.ok:
        assert r.status == 200 and r.ttft_s is not None and r.event_times
        assert r.t_start < r.event_times[0] <= r.event_times[-1] <= r.t_end
    assert load.output_tokens_per_s > 0 and load.wall_s > 0


def test_load_generator_reports_an_unreachable_server_as_errors():
    from jaxlab.serve.loadgen import closed_loop, completion_bodies
    from jaxlab.serve.server import bind_socket

    sock = bind_socket("127.0.0.1", 0)  # a port nothing listens on once closed
    port = sock.getsockname()[1]
    sock.close()
    load = closed_loop(f"http://127.0.0.1:{port}", completion_bodies(["hi"] * 2, 4), 2)
    assert load.errors == 2 and not load.ok
    assert all(r.status == 0 and r.error for r in load.results)
    assert sum(load.error_summary().values()) == 2


def test_zz_nothing_compiled_while_serving(server, engine):
    """Runs last in the module: all the traffic above compiled nothing new."""
    warm = sched(server).compiles_after_warmup
    assert warm is not None
    # One prefill per (kind, length bucket, row bucket): chunks from a prompt's start and
    # past it, of the one bucket that holds serve.prefill_chunk_tokens = 32, in calls of 1,
    # 2 and 4 rows (serve.prefill_batch = the 4 slots here); insert once per row bucket (a
    # 1-row prefill also frees a slot); generate for a slot group's rows once per staged
    # length (the table's span, in page buckets of the 128-token cache).
    assert warm["prefill"] == 2 * 1 * 3 == 6
    assert engine.stage_lengths == (64, 96, 128)
    assert warm["insert"] == 3 and warm["generate"] == 3
    assert engine.compiles == warm
