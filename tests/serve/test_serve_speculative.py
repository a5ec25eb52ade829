"""A server that speculates (``inference.speculative``), end to end: real uvicorn on
127.0.0.1, the trained tiny run of ``test_serve_api`` (trained once per session). Greedy
answers equal offline plain generation; the answers report what was drafted and accepted;
the two spec-decode counters move; nothing compiles after warm-up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import RUN_STEPS, train_tiny
from test_serve_api import OVERRIDES, load_model, metric, metrics, offline

from jaxlab.config import JaxlabConfig
from jaxlab.serve import ModelService, ServerThread, serve_config

#: Prompts after which the tiny model's greedy output repeats itself (lookup finds drafts),
#: and one of every byte class (it finds few).
PROMPTS = ["abcabcabcabcabcabc", "the cat sat on the mat; the cat sat", "q7#Zk!x 0Lw;"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "serve-run"  # test_serve_api's, if it ran
    if not (path / "checkpoints" / str(RUN_STEPS)).is_dir():
        train_tiny(path)
    return path


@pytest.fixture(scope="module")
def cfg(run_dir: Path) -> JaxlabConfig:
    return serve_config(run_dir, [*OVERRIDES, "inference.speculative.method=ngram"], environ={})


@pytest.fixture(scope="module")
def server(run_dir: Path, cfg: JaxlabConfig) -> Iterator[ServerThread]:
    """The run served the way ``jaxlab serve`` serves it: the service wraps the engine."""
    plain = load_model(run_dir, cfg)
    svc = ModelService.from_engine(plain.engine, plain.tokenizer, cfg, checkpoint_step=RUN_STEPS)
    srv = ServerThread(svc).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_speculating_server_answers_plain_greedy_and_reports_its_drafts(server, run_dir, cfg):
    from jaxlab.infer.sampling import SamplingParams

    info = httpx.get(server.url + "/ready").json()
    assert info["speculative"] == {"method": "ngram", "k": 6, "draft_run_dir": None}
    before = metrics(server.url)

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            native = [
                client.post("/v1/generate", json={"prompt": p, "max_tokens": 60, "seed": 1})
                for p in PROMPTS
            ]
            openai = [
                client.post(
                    "/v1/completions",
                    json={"model": "jaxlab", "prompt": p, "max_tokens": 60, "temperature": 0},
                )
                for p in PROMPTS
            ]
            return await asyncio.gather(*native, *openai)

    responses = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    native, openai = [r.json() for r in responses[:3]], [r.json() for r in responses[3:]]

    plain = load_model(run_dir, cfg.model_copy(deep=True))
    assert not hasattr(plain.engine, "target")  # the reference does not speculate
    expected = offline(plain, [(p, SamplingParams(max_new_tokens=60)) for p in PROMPTS])
    for want, got, doc in zip(expected, native, openai, strict=True):
        assert got["token_ids"] == want.token_ids
        assert doc["choices"][0]["text"] == got["text"] == want.text
        spec = got["speculative"]
        assert set(spec) == {"draft_tokens", "accepted_tokens", "switched_off"}
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        usage = doc["usage"]
        details = usage["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] == usage["speculative"]["accepted_tokens"]
        assert details["rejected_prediction_tokens"] == (
            usage["speculative"]["draft_tokens"] - usage["speculative"]["accepted_tokens"]
        )
    drafted = sum(d["speculative"]["draft_tokens"] for d in native)
    accepted = sum(d["speculative"]["accepted_tokens"] for d in native)
    assert accepted > 0 and drafted > accepted  # the repetitive prompt's drafts are kept

    after = metrics(server.url)
    moved = {
        name: metric(after, name) - metric(before, name)
        for name in (
            "jaxlab_spec_decode_draft_tokens_total",
            "jaxlab_spec_decode_accepted_tokens_total",
        )
    }
    both = [*native, *(d["usage"] for d in openai)]
    assert moved["jaxlab_spec_decode_draft_tokens_total"] == sum(
        d["speculative"]["draft_tokens"] for d in both
    )
    assert moved["jaxlab_spec_decode_accepted_tokens_total"] == sum(
        d["speculative"]["accepted_tokens"] for d in both
    )
    sched = server.service.scheduler
    assert sched is not None and sched.compiles_after_warmup == dict(sched.engine.compiles)
    assert sched.compiles_after_warmup["spec_generate"] == 1


def test_a_server_that_does_not_speculate_answers_without_the_fields():
    """Without ``inference.speculative`` the answers keep their plain shape."""
    from jaxlab.serve.protocol import usage_doc

    assert "speculative" not in usage_doc(3, 4, 0)
    assert "completion_tokens_details" not in usage_doc(3, 4, 0)
    doc = usage_doc(3, 4, 0, {"draft_tokens": 8, "accepted_tokens": 5, "switched_off": False})
    assert doc["completion_tokens_details"] == {
        "accepted_prediction_tokens": 5,
        "rejected_prediction_tokens": 3,
    }
