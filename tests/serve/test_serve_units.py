"""Pure-Python pieces of the server: lifecycle, stop strings, request parsing, the error
mapping, config."""

from __future__ import annotations

import gc

import pytest

from jaxlab.config import ConfigError
from jaxlab.infer.request import BadRequest, RequestError, RequestTooLong
from jaxlab.serve.app import api_error
from jaxlab.serve.errors import (
    Cancelled,
    EngineFailure,
    NotAccepting,
    QueueFull,
    RequestTimeout,
    ShuttingDown,
)
from jaxlab.serve.lifecycle import TRANSITIONS, IllegalTransition, Lifecycle, ModelState
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.protocol import (
    RANGES,
    ApiError,
    CompletionBody,
    GenerateBody,
    parse_json,
    validate,
)
from jaxlab.tokenizer import Detokenizer, byte_tokenizer

S = ModelState


def test_lifecycle_happy_path_and_listeners():
    lc = Lifecycle()
    seen: list[tuple[str, str]] = []
    lc.add_listener(lambda a, b: seen.append((a.value, b.value)))
    for s in (S.LOADING, S.WARMING, S.READY, S.DRAINING, S.STOPPED):
        lc.to(s)
    assert lc.state == S.STOPPED
    assert seen == [
        ("empty", "loading"),
        ("loading", "warming"),
        ("warming", "ready"),
        ("ready", "draining"),
        ("draining", "stopped"),
    ]
    assert [s for s, _ in lc.history] == [
        S.EMPTY,
        S.LOADING,
        S.WARMING,
        S.READY,
        S.DRAINING,
        S.STOPPED,
    ]


@pytest.mark.parametrize(
    "path",
    [
        (S.READY,),  # empty -> ready skips loading and warming
        (S.LOADING, S.READY),  # no warm-up
        (S.LOADING, S.WARMING, S.READY, S.WARMING),  # back
        (S.LOADING, S.WARMING, S.READY, S.STOPPED),  # stop without draining
        (S.LOADING, S.FAILED, S.LOADING),  # failed is terminal
        (S.LOADING, S.WARMING, S.READY, S.DRAINING, S.READY),  # no un-draining
    ],
)
def test_lifecycle_illegal_transitions_raise(path):
    lc = Lifecycle()
    *ok, bad = path
    for s in ok:
        lc.to(s)
    before = lc.state
    with pytest.raises(IllegalTransition, match=f"{before} -> {bad}"):
        lc.to(bad)
    assert lc.state == before


def test_every_state_reaches_a_terminal_state():
    for state in ModelState:
        seen, todo = set(), [state]
        while todo:
            s = todo.pop()
            seen.add(s)
            todo += [n for n in TRANSITIONS[s] if n not in seen]
        assert seen & {S.STOPPED, S.FAILED}, state


def test_model_state_gauge_is_one_hot():
    m = ServeMetrics()
    m.set_state(S.WARMING)
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    values = {s.labels["state"]: s.value for s in fams["jaxlab_model_state"].samples}
    assert values == {s.value: (1.0 if s == S.WARMING else 0.0) for s in ModelState}


# ----------------------------------------------------------------------------- text


def _assemble(text: str, stop: list[str]) -> tuple[list[str], Detokenizer]:
    tok = byte_tokenizer()
    asm = Detokenizer(tok, stop)
    deltas = []
    for t in tok.encode(text):
        deltas.append(asm.feed(t))
        if asm.stopped:
            break
    deltas.append(asm.finish())
    return deltas, asm


def test_text_without_stops_streams_every_byte_and_never_splits_utf8():
    text = "héllo wörld ✓ 🚀 done"
    deltas, asm = _assemble(text, [])
    assert "".join(deltas) == text == asm.text
    assert all("\ufffd" not in d for d in deltas)
    assert not asm.stopped


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("count: 1 2 3 STOP 4 5", ["STOP"], "count: 1 2 3 "),
        ("abcabcabd", ["abd"], "abcabc"),
        ("first\n\nsecond", ["\n\n", "sec"], "first"),
        ("no stop here", ["zzz"], "no stop here"),
        ("ends with a partial ST", ["STOP"], "ends with a partial ST"),
        ("✓✓x✓", ["x✓"], "✓✓"),
    ],
)
def test_stop_strings_truncate_and_streaming_equals_final_text(text, stop, expected):
    deltas, asm = _assemble(text, stop)
    assert asm.text == expected
    assert "".join(deltas) == expected
    assert asm.stopped == (expected != text)


def test_held_back_text_is_released_when_the_stop_does_not_complete():
    tok = byte_tokenizer()
    asm = Detokenizer(tok, ["STOP"])
    out = [asm.feed(t) for t in tok.encode("a ST")]
    assert "".join(out) == "a "  # "ST" might begin "STOP"
    assert asm.feed(tok.encode("x")[0]) == "STx"
    assert asm.finish() == ""


def test_unknown_token_ids_become_replacement_characters():
    tok = byte_tokenizer()
    asm = Detokenizer(tok, [])
    assert asm.feed(tok.n_vocab + 5) == "\ufffd"
    assert asm.feed(ord("a")) == "a"


# ----------------------------------------------------------------------------- protocol


def test_parse_json_and_validate_errors_are_openai_shaped():
    with pytest.raises(ApiError) as e:
        parse_json(b"{not json")
    assert e.value.status == 400 and e.value.code == "invalid_json"
    with pytest.raises(ApiError) as e:
        parse_json(b"[1, 2]")
    assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {"prompt": "x", "max_tokens": "5"})
    body = e.value.body()
    assert e.value.status == 422
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == "max_tokens"
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {"prompt": "x", "temprature": 0.5})
    assert e.value.code == "unknown_field" and e.value.param == "temprature"
    with pytest.raises(ApiError) as e:
        validate(GenerateBody, {})
    assert e.value.code == "missing" and e.value.param == "prompt"


def test_completion_body_accepts_openai_extras_and_refuses_unsupported_features():
    body = validate(CompletionBody, {"model": "m", "prompt": ["one"], "user": "u", "top_k": 3})
    assert body.single_prompt() == "one" and body.top_k == 3
    defaults = {"n": 1, "echo": False, "logprobs": None, "best_of": 1, "presence_penalty": 0}
    validate(
        CompletionBody, {"prompt": "a", "frequency_penalty": 0.0, "logit_bias": {}, **defaults}
    )
    with pytest.raises(ApiError, match="one prompt per request"):
        validate(CompletionBody, {"prompt": ["a", "b"]}).single_prompt()
    refused = [("n", 2), ("n", -(10**30)), ("echo", True), ("logprobs", 0), ("best_of", 3)]
    refused += [("presence_penalty", float("nan")), ("logit_bias", {"5": 1.0}), ("suffix", "")]
    for field, value in refused:
        with pytest.raises(ApiError) as e:
            validate(CompletionBody, {"prompt": "a", field: value})
        assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported")
        assert f"{field} = " in e.value.message and "leave it out" in e.value.message
    assert validate(CompletionBody, {"prompt": "a", "stop": "x"}).stop_strings() == ("x",)
    with pytest.raises(ApiError, match="at most 4"):
        validate(CompletionBody, {"prompt": "a", "stop": list("abcde")})


@pytest.mark.parametrize("body", [CompletionBody, GenerateBody])
@pytest.mark.parametrize("field", sorted(RANGES))
def test_every_numeric_field_out_of_its_range_is_400_naming_the_field_and_the_range(body, field):
    """Both ends of each range are taken, a step past either end is 400 (not 422: the
    type is right, the value is not), and the message gives the field, range and value."""
    valid = RANGES[field]
    step = 1 if valid.integer else 1e-9
    for ok in (valid.lo, valid.hi, *([0] if valid.zero else [])):
        ok = int(ok) if valid.integer else float(ok)
        assert getattr(validate(body, {"prompt": "a", field: ok}), field) == ok
    outside = [valid.hi + step, valid.lo - step, -(10**30), 10**30]
    outside += [-step] if valid.zero else []  # 0 is valid, below it is not
    outside += [] if valid.integer else [float("inf"), float("-inf"), float("nan")]
    for bad in outside:
        bad = int(bad) if valid.integer else float(bad)
        with pytest.raises(ApiError) as e:
            validate(body, {"prompt": "a", field: bad})
        assert (e.value.status, e.value.param, e.value.code) == (400, field, "invalid_value")
        assert e.value.message.startswith(f"{field} must be {valid.describe()} (got ")


def test_wrong_types_stay_422():
    for field, value in (("top_k", 1.0), ("max_tokens", "5"), ("seed", True), ("top_p", "1")):
        with pytest.raises(ApiError) as e:
            validate(GenerateBody, {"prompt": "a", field: value})
        assert (e.value.status, e.value.param) == (422, field)


def test_bodies_that_cannot_be_parsed_are_400_invalid_json():
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for raw in (
        deep,
        nested,
        b'{"temperature": NaN}',
        b"[Infinity]",
        b"\xff\xfe",
        b"",
        b"1" * 5000,
    ):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert (e.value.status, e.value.code) == (400, "invalid_json"), raw[:20]
    assert parse_json(b'{"temperature": 1e309}') == {"temperature": float("inf")}


@pytest.mark.parametrize(
    ("error", "status", "code", "retry_after"),
    [
        (QueueFull(3), 503, "queue_full", "1"),
        (NotAccepting("loading"), 503, "not_ready", "5"),
        (NotAccepting("draining"), 503, "draining", "5"),
        (ShuttingDown(), 503, "shutting_down", None),
        (RequestTimeout(1.5), 504, "timeout", None),
        (Cancelled(), 499, "cancelled", None),
        (EngineFailure("decode failed: boom"), 500, "internal_error", None),
        (RequestTooLong("too long", param="prompt"), 400, "context_length_exceeded", None),
        (BadRequest("empty", param="prompt"), 400, "invalid_request", None),
    ],
)
def test_every_domain_error_maps_to_one_status_in_the_app(error, status, code, retry_after):
    err = api_error(error)
    assert (err.status, err.code) == (status, code)
    assert err.headers.get("Retry-After") == retry_after
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] == str(error)
    if isinstance(error, RequestError):
        assert body["param"] == "prompt"


# ----------------------------------------------------------------------------- config


def test_serve_config_takes_the_run_config_and_only_serving_overrides(tmp_path):
    from jaxlab.config import load_config, to_toml
    from jaxlab.serve.config import serve_config

    cfg = load_config("tiny")
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    out = serve_config(
        tmp_path,
        ["serve.max_queue=3", "inference.stream_chunk_tokens=4"],
        environ={"JAXLAB_SERVE__API_KEY": "sekrit"},
        port=0,
        slots=2,
    )
    assert out.model == cfg.model
    assert (out.serve.max_queue, out.serve.port, out.serve.slots) == (3, 0, 2)
    assert out.inference.stream_chunk_tokens == 4
    assert out.serve.api_key is not None and out.serve.api_key.get_secret_value() == "sekrit"
    with pytest.raises(ConfigError, match="only overrides"):
        serve_config(tmp_path, ["model.d_model=128"])
    with pytest.raises(ConfigError, match="not a run directory"):
        serve_config(tmp_path / "nope")


def test_heap_freezes_nest_and_the_last_thaw_unfreezes():
    from jaxlab.serve import service

    assert service._frozen_services == 0, "a server from an earlier test is still running"
    probe = [object()]  # a list: tracked by the collector
    service._freeze_startup_heap()
    service._freeze_startup_heap()
    try:
        assert not any(o is probe for o in gc.get_objects())
        service._thaw_startup_heap()
        assert gc.get_freeze_count() > 0  # one service is still serving
    finally:
        service._thaw_startup_heap()
    assert gc.get_freeze_count() == 0
    assert any(o is probe for o in gc.get_objects())


def test_completions_url_keeps_a_path_prefix():
    from jaxlab.serve.loadgen import completions_url

    assert completions_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1/completions"
    assert completions_url("http://h:1/api/") == "http://h:1/api/v1/completions"
