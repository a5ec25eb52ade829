"""The service's glue without HTTP or a model: a fake engine behind the real lifecycle,
scheduler thread and request path (``ModelService.request`` -> ``submit`` -> events)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine

from jaxlab.config import load_config
from jaxlab.infer.request import BadRequest, RequestTooLong
from jaxlab.infer.sampling import SamplingParams
from jaxlab.serve import ModelService, ModelState, NotAccepting
from jaxlab.serve.output import Event, RequestStream
from jaxlab.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


@pytest.fixture
def service() -> Iterator[tuple[ModelService, FakeEngine]]:
    cfg = load_config(
        "tiny",
        ["serve.slots=2", "serve.decode_groups=1", "inference.stream_chunk_tokens=3"],
        environ={},
    )
    engine = FakeEngine()
    svc = ModelService.from_engine(engine, TOK, cfg, checkpoint_step=7)  # type: ignore[arg-type]
    svc.start()
    try:
        assert svc.wait_ready(30) == ModelState.READY
        yield svc, engine
    finally:
        svc.stop()


def events(out: RequestStream) -> list[Event]:
    evs = [out.get(timeout=10)]
    while evs[-1].kind == "tokens":
        evs.append(out.get(timeout=10))
    return evs


def test_a_request_goes_from_text_to_events_and_each_check_is_made_once(service):
    svc, engine = service
    info = svc.info()
    assert (info["checkpoint_step"], info["slots"], info["decode_groups"]) == (7, 2, 1)
    assert info["chunk_tokens"] == 3 and info["max_len"] == engine.max_len
    req = svc.request("héllo", SamplingParams(max_new_tokens=9, seed=4), stop=["zz"])
    assert req.prompt_ids == tuple(TOK.encode("héllo"))
    assert req.stop_ids == {TOK.eot_id} and req.stop == ("zz",)  # EOS folded in, once
    out = svc.submit(req, stream=True)
    evs = events(out)
    want = engine.reference(req)
    assert out.token_ids == [t for t in want if t not in req.stop_ids]
    assert "".join(e.text for e in evs) == out.output_text == bytes(out.token_ids).decode()
    assert evs[-1] == Event("done", finish_reason="length")
    assert 0 <= out.queue_s <= out.ttft_s <= out.total_s


def test_request_errors_name_the_field_and_admission_follows_the_lifecycle(service):
    svc, _ = service
    with pytest.raises(RequestTooLong) as too_long:
        svc.request("x" * 60, SamplingParams(max_new_tokens=10))
    assert too_long.value.param == "prompt" and "inference.max_len" in str(too_long.value)
    with pytest.raises(BadRequest) as empty:
        svc.request("", SamplingParams(max_new_tokens=1))
    assert empty.value.param == "prompt"
    ok = svc.request("ab", SamplingParams(max_new_tokens=2))
    assert svc.begin_drain() and svc.state == ModelState.DRAINING
    with pytest.raises(NotAccepting) as e:
        svc.request("ab", SamplingParams(max_new_tokens=2))
    assert e.value.state == "draining"
    with pytest.raises(NotAccepting):
        svc.submit(ok)


def test_a_request_that_can_never_fit_the_kv_pool_is_refused_before_it_queues():
    """A pool of 4 pages of 4 tokens (the engine sizes it: ``pool_pages``): ``request()``
    refuses prompt + max_tokens over 16 tokens (the one check, before submit), naming the
    pool; the scheduler's own ``submit`` refuses it too, for a caller that skips the
    check."""
    cfg = load_config("tiny", ["serve.slots=2", "serve.decode_groups=1"], environ={})
    engine = FakeEngine(page_size=4, num_pages=4)
    svc = ModelService.from_engine(engine, TOK, cfg)  # type: ignore[arg-type]
    svc.start()
    try:
        assert svc.wait_ready(30) == ModelState.READY
        assert svc.info()["kv_pages"] == 4 and svc.info()["page_size"] == 4
        with pytest.raises(RequestTooLong) as e:
            svc.request("x" * 10, SamplingParams(max_new_tokens=7))
        assert e.value.param == "prompt" and "inference.num_pages" in str(e.value)
        ok = svc.request("x" * 10, SamplingParams(max_new_tokens=6))
        assert events(svc.submit(ok))[-1].kind == "done"
        from jaxlab.infer.request import Request

        unchecked = Request(ok.prompt_ids, SamplingParams(max_new_tokens=7))
        with pytest.raises(RequestTooLong):
            svc.submit(unchecked)
    finally:
        svc.stop()
