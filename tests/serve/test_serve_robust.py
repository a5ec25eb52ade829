# The fixtures imported from test_serve_api are these tests' parameters.
# ruff: noqa: F811
"""Hostile clients against the real server: no client input gets a 5xx, one request never
fails another, bodies that cannot be parsed, clients that leave.

Real uvicorn on 127.0.0.1 (ephemeral ports) over the trained tiny model of
:mod:`test_serve_api`, whose fixtures and helpers are reused; raw sockets where a test
needs the connection itself (keep-alive after an error, a client gone mid-body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Iterator
from typing import Any, BinaryIO

import httpx
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_serve_api import (  # fixtures (cfg, model, run_dir, server) and helpers
    ERROR_KEYS,
    assert_error,
    cfg,  # noqa: F401
    metric,
    metrics,
    model,  # noqa: F401
    parse_sse,
    real_chunks,
    run_dir,  # noqa: F401
    sched,
    server,  # noqa: F401
    serving,
    wait_until,
)

from jaxlab.serve.protocol import RANGES, UNSUPPORTED

GEN, COMP = "/v1/generate", "/v1/completions"


def five_hundreds(url: str) -> float:
    """``jaxlab_requests_total`` over every 5xx status so far."""
    return sum(
        v
        for (name, labels), v in metrics(url).items()
        if name == "jaxlab_requests_total" and dict(labels)["status"].startswith("5")
    )


# ----------------------------------------------------------------------------- raw HTTP


def connect(url: str) -> socket.socket:
    u = httpx.URL(url)
    return socket.create_connection((u.host, u.port or 80), timeout=60)


def send(sock: socket.socket, path: str, body: bytes, *, length: int | None = None) -> None:
    """One keep-alive POST; ``length`` (default: the body's) is the Content-Length sent."""
    n = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {n}\r\n\r\n".encode() + body)


def receive(reader: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """One response (status, lower-cased headers, body) from a socket's reader."""
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers.get("content-length", 0)))


@contextlib.contextmanager
def raw_connection(url: str) -> Iterator[tuple[socket.socket, BinaryIO]]:
    with contextlib.closing(connect(url)) as sock, sock.makefile("rb") as reader:
        yield sock, reader


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


# ----------------------------------------------------------------------------- ranges


def test_numbers_out_of_range_are_400_naming_the_field_and_its_range(server):
    """The issue's case first: a top_k past int32 used to reach the device, where building
    the prefill's int32 arrays failed the whole batch with a 500."""
    url = server.url
    issue = httpx.post(url + GEN, json={"prompt": "x", "top_k": 99999999999})
    err = assert_error(issue, 400, "invalid_value")
    assert err["param"] == "top_k"
    assert err["message"] == (
        "top_k must be an integer in [0, 2147483647], 0 = off (got 99999999999)"
    )
    # JSON literals as a client may write them: 1e309 parses to inf, NaN is not JSON.
    cases = [
        ("top_k", "-1"),
        ("seed", "2147483648"),
        ("seed", "-1"),
        ("max_tokens", "0"),
        ("max_tokens", "1" + "0" * 40),
        ("temperature", "1e309"),
        ("temperature", "-0.5"),
        ("temperature", "0.001"),
        ("temperature", "100.5"),
        ("top_p", "0"),
        ("top_p", "1e-7"),
        ("top_p", "1.5"),
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        for path in (GEN, COMP):
            for field, literal in cases:
                r = client.post(path, content=f'{{"prompt": "x", "{field}": {literal}}}')
                err = assert_error(r, 400, "invalid_value")
                assert err["param"] == field, (path, field, literal)
                assert err["message"].startswith(f"{field} must be {RANGES[field].describe()}")
        refused = [("n", "1" + "0" * 30), ("n", "0"), ("logprobs", "5"), ("best_of", "2")]
        refused += [("presence_penalty", "1e309"), ("logit_bias", '{"1": -1e309}')]
        for field, literal in refused:
            r = client.post(COMP, content=f'{{"prompt": "x", "{field}": {literal}}}')
            err = assert_error(r, 400, "unsupported")
            assert err["param"] == field and "leave it out" in err["message"]
            assert field in UNSUPPORTED
        # Every end of every range is served.
        edges = {"max_tokens": 2, "temperature": 100.0, "top_k": 2**31 - 1, "top_p": 1e-6}
        for seed in (0, 2**31 - 1):
            for temperature in (0.0, 0.01, 100.0):
                body = {"prompt": "edge", **edges, "temperature": temperature, "seed": seed}
                assert client.post(GEN, json=body).status_code == 200
    assert five_hundreds(url) == 0


# ----------------------------------------------------------------------------- isolation


def test_a_request_that_fails_in_prefill_fails_alone(model, cfg, monkeypatch):
    """Three HTTP requests and an unchecked one (a top_k no int32 holds, queued straight
    into the service) are admitted together. The unchecked one fails on the host before
    the prefill; the device prefill raises for one prompt, so a call that holds it is
    prefilled again one by one: that request gets a 500, the others exactly what they get
    alone."""
    from jaxlab.infer.request import Request
    from jaxlab.infer.sampling import SamplingParams

    with serving(model, cfg) as srv:
        url, svc = srv.url, srv.service
        assert svc.model is not None
        eng, tok = svc.model.engine, svc.model.tokenizer
        compiles = dict(eng.compiles)
        prompts = ["alpha", "poison pill", "gamma ray"]
        bodies = [
            {"prompt": p, "max_tokens": 8, "temperature": 0.8, "seed": i}
            for i, p in enumerate(prompts)
        ]
        alone = [httpx.post(url + GEN, json=b, timeout=60).json()["text"] for b in bodies]
        poisoned = tuple(tok.encode("poison pill"))
        real, calls = eng.prefill, []

        def prefill(state: Any, chunks: Any) -> Any:
            prompts = [tuple(c.tokens) for c in chunks if c.start == 0 and c.last]
            calls.append((len(real_chunks(srv, chunks)), poisoned in prompts))
            if poisoned in prompts:
                raise RuntimeError("the device broke on this prompt")
            return real(state, chunks)

        monkeypatch.setattr(eng, "prefill", prefill)
        sc = sched(srv)
        sc.pause_admission()
        unchecked = Request(
            tuple(tok.encode("zeta")), SamplingParams(max_new_tokens=4, top_k=2**40)
        )
        stuck = svc.submit(unchecked)

        async def together() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                sent = [asyncio.ensure_future(client.post(GEN, json=b)) for b in bodies]
                while sc.num_waiting < 4:
                    await asyncio.sleep(0.01)
                sc.resume_admission()
                return list(await asyncio.gather(*sent))

        answers = asyncio.run(together())
        # One call per slot group; the one that held the poisoned prompt, if it held two,
        # again one by one (the poisoned one alone fails again).
        bad = [i for i, (_, poison) in enumerate(calls) if poison]
        assert calls[bad[-1]] == (1, True)
        if calls[bad[0]][0] == 2:
            assert calls[bad[0] + 1 : bad[0] + 3] in (
                [(1, False), (1, True)],
                [(1, True), (1, False)],
            )
        err = assert_error(answers[1], 500, "internal_error")
        assert "prefill failed: the device broke on this prompt" in err["message"]
        for i in (0, 2):
            assert answers[i].status_code == 200 and answers[i].json()["text"] == alone[i]
        event = stuck.get(timeout=30)
        assert event.kind == "error" and "top_k = 1099511627776 does not fit int32" in str(
            event.error
        )
        assert eng.compiles == compiles  # the one-by-one prefills were compiled by warm-up
        m = metrics(url)
        assert metric(m, "jaxlab_requests_total", status="500") == 1
        assert metric(m, "jaxlab_num_requests_running") == 0


# ----------------------------------------------------------------------------- bodies


def test_bodies_nested_too_deeply_are_400_and_the_connection_stays_usable(server, caplog):
    before = metrics(server.url)
    deep = b"[" * 50_000 + b"]" * 50_000
    in_a_field = b'{"prompt": "x", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    with raw_connection(server.url) as (sock, reader):
        for path, body in ((GEN, deep), (COMP, in_a_field)):
            send(sock, path, body)
            status, headers, payload = receive(reader)
            assert status == 400, payload
            err = json.loads(payload)["error"]
            assert set(err) == ERROR_KEYS and err["code"] == "invalid_json", err
            assert "nested too deeply" in err["message"]
            assert headers.get("connection") != "close"
        # the same connection serves the next request
        send(sock, GEN, json.dumps({"prompt": "still here", "max_tokens": 2}).encode())
        status, _, payload = receive(reader)
        assert status == 200 and json.loads(payload)["generated_tokens"] >= 1
    after = metrics(server.url)
    delta = metric(after, "jaxlab_requests_total", status="400") - metric(
        before, "jaxlab_requests_total", status="400"
    )
    assert delta == 2 and five_hundreds(server.url) == 0
    no_tracebacks(caplog)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe\x00", b'{"prompt": NaN}', b"1" * 5000],
)
def test_any_body_that_is_not_a_json_object_is_400(server, raw):
    for path in (GEN, COMP):
        assert_error(httpx.post(server.url + path, content=raw), 400, "invalid_json")


# ----------------------------------------------------------------------------- disconnects


def test_a_client_that_leaves_counts_as_499_and_logs_no_traceback(model, cfg, caplog):
    """Gone before its body was read (headers only, promising a body), gone mid-body, and
    gone while its request runs: each is a 499 in ``jaxlab_requests_total``, one log line,
    no traceback, and its slot is free."""
    caplog.set_level(logging.INFO, logger="jaxlab.serve")
    with serving(model, cfg, chunk_delay_s=0.2) as srv:
        url = srv.url
        body = json.dumps({"prompt": "bye", "max_tokens": 80}).encode()
        with raw_connection(url) as (sock, _):
            send(sock, GEN, b"", length=len(body))
        with raw_connection(url) as (sock, _):
            send(sock, COMP, body[: len(body) // 2], length=len(body))
        with raw_connection(url) as (sock, _):
            send(sock, GEN, body)
            wait_until(lambda: sched(srv).num_running == 1)
        wait_until(lambda: metric(metrics(url), "jaxlab_requests_total", status="499") == 3)
        wait_until(lambda: sched(srv).idle)
        m = metrics(url)
        assert five_hundreds(url) == 0
        assert metric(m, "jaxlab_num_requests_running") == 0
        # and the server still answers
        ok = httpx.post(url + GEN, json={"prompt": "hello", "max_tokens": 1}, timeout=60)
        assert ok.status_code == 200
    gone = [r.getMessage() for r in caplog.records if "client disconnected" in r.getMessage()]
    assert sorted(gone) == sorted(
        [f"POST {p}: the client disconnected (499)" for p in (GEN, COMP, GEN)]
    )
    no_tracebacks(caplog)


# ----------------------------------------------------------------------------- fuzzing


class Raw(str):
    """A JSON value written as it is: a number ``json.dumps`` cannot write (``1e309``, a
    400-digit integer), one JSON does not have (``NaN``), an escaped lone surrogate."""


def dump(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


LITERALS = [
    "1e309",
    "-1e309",
    "1e-400",
    "-0",
    "-0.0",
    "5e-324",
    "3.5e38",
    "0.009",
    "1e-7",
    "100.0000001",
    "2147483647",
    "2147483648",
    "-2147483649",
    "4294967296",
    "9223372036854775808",
    "1" + "0" * 400,
    "-" + "9" * 400,
    "NaN",
    "Infinity",
    "-Infinity",
    '"\\ud800"',
    '"a\\udfffb"',
    '"\\u0000"',
]
NUMBERS = st.one_of(
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(LITERALS).map(Raw),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=12))
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
VALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.text(min_size=1, max_size=24)
    | st.lists(st.text(max_size=8), min_size=1, max_size=2),
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0.0, 0.01, 0.7, 100.0]),
    "top_k": st.sampled_from([0, 1, 40, 2**31 - 1]),
    "top_p": st.sampled_from([1e-6, 0.5, 1.0]),
    "seed": st.sampled_from([0, 7, 2**31 - 1]),
    "stop": st.sampled_from([None, "\n", "a", ["x", "y"]]),
    "ignore_eos": st.booleans(),
    "model": st.sampled_from([None, "jaxlab"]),
    "stream": st.booleans(),
    "stream_options": st.sampled_from([None, {"include_usage": True}, {"include_usage": False}]),
    "n": st.just(1),
    "echo": st.just(False),
    "logprobs": st.none(),
    "best_of": st.sampled_from([None, 1]),
    "suffix": st.none(),
    "presence_penalty": st.sampled_from([None, 0, 0.0]),
    "frequency_penalty": st.sampled_from([None, 0.0]),
    "logit_bias": st.sampled_from([None, {}]),
    "user": st.text(max_size=8),
}
SHARED = ["prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos"]
FIELDS = {GEN: SHARED, COMP: [*SHARED, "model", "stream", "stream_options", *UNSUPPORTED, "user"]}


HOSTILE = st.one_of(NUMBERS, ANY_JSON)


@st.composite
def bodies(draw: st.DrawFn, path: str) -> Any:
    """A body for ``path``: a valid one, one with one field set to anything at all, or
    one whose every field is left out, valid or anything; now and then an unknown field,
    or a body that is not an object."""
    if draw(st.integers(0, 19)) == 0:
        return draw(ANY_JSON)
    body = {}
    mode = draw(st.sampled_from(["valid", "one hostile field", "mixed"]))
    if mode != "mixed":
        body = {name: draw(VALID[name]) for name in FIELDS[path] if draw(st.booleans())}
        body["prompt"] = draw(VALID["prompt"])
        if mode == "one hostile field":
            body[draw(st.sampled_from(FIELDS[path]))] = draw(HOSTILE)
    else:
        for name in FIELDS[path]:
            how = draw(st.sampled_from(["out", "valid", "valid", "any"]))
            if how != "out":
                body[name] = draw(VALID[name] if how == "valid" else HOSTILE)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(ANY_JSON)
    return body


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_no_client_input_gets_a_5xx(server, client, data):
    """Any body for either endpoint is answered 2xx, or 4xx with an OpenAI-shaped error
    body; a stream carries no error event."""
    path = data.draw(st.sampled_from([GEN, COMP]))
    content = dump(data.draw(bodies(path)))
    r = client.post(path, content=content.encode())
    event(f"status {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert r.status_code < 500, (content[:300], r.text[:300])
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert all("error" not in chunk for chunk in parse_sse(r.text)), r.text[:300]
    else:
        assert r.status_code == 200 and ("text" in r.json() or "choices" in r.json())


EDGE_NUMBERS = [
    "1e309",
    "-1e309",
    "1e-400",
    "-0",
    "-0.0",
    "0",
    "1",
    "1.0",
    "0.01",
    "0.0099999",
    "100",
    "100.00001",
    "1e-6",
    "9.99e-7",
    "2147483647",
    "2147483648",
    "-2147483649",
]
NUMBER_TEXT = st.one_of(
    st.integers(0, 100).map(str),
    st.floats(0.0, 1.0).map(repr),
    st.integers(-(2**80), 2**80).map(str),
    st.integers().map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from(EDGE_NUMBERS),
)
LIMIT = 100  # serve.max_tokens_limit in test_serve_api's config
INT_FIELDS = {"max_tokens", "top_k", "seed", "n", "logprobs", "best_of"}
NUMERIC = [*RANGES, "n", "logprobs", "best_of", "presence_penalty", "frequency_penalty"]


def expected(field: str, value: Any) -> tuple[int, str | None]:
    """The status and code a body of ``{"prompt": "x", field: value}`` must get."""
    if field in INT_FIELDS and isinstance(value, float):
        return 422, "invalid_value"  # strict: 1.0 is not an integer
    if field not in INT_FIELDS and isinstance(value, int) and abs(value) > 2**1023:
        return 422, "invalid_value"  # no float holds it
    if field in RANGES:
        if not RANGES[field].contains(value):
            return 400, "invalid_value"
        if field == "max_tokens" and value > LIMIT:
            return 400, "max_tokens_exceeded"
        return 200, None
    return (
        (200, None)
        if value in [v for v in UNSUPPORTED[field] if v is not None]
        else (400, "unsupported")
    )


@pytest.mark.parametrize("field", NUMERIC)
@settings(max_examples=30, deadline=None)
@given(completions=st.booleans(), text=NUMBER_TEXT)
def test_any_number_in_a_numeric_field_is_served_or_refused_naming_it(
    server, client, field, completions, text
):
    """Every numeric field of both endpoints, any JSON number: in its range it is served
    (200), outside it 400 naming the field, a float for an integer field 422."""
    path = COMP if completions or field not in RANGES else GEN  # refused: OpenAI's fields
    head = '"prompt": "x"' if field == "max_tokens" else '"prompt": "x", "max_tokens": 1'
    r = client.post(path, content=f'{{{head}, "{field}": {text}}}')
    status, code = expected(field, json.loads(text))
    event(f"status {status}")
    if status == 200:
        assert r.status_code == 200, (field, text, r.text)
    else:
        assert assert_error(r, status, code)["param"] == field, (field, text)


def test_zz_the_fuzzing_left_no_5xx_and_nothing_running(server):
    assert five_hundreds(server.url) == 0
    wait_until(lambda: sched(server).idle)
