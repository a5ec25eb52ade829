"""``POST /v1/chat/completions`` end to end: real uvicorn on 127.0.0.1 (an ephemeral port),
raw HTTP and the official ``openai`` client.

The model is the ``tiny`` shape with the byte tokenizer and its chat tokens, untrained
(seed 0), with two columns of its LM head swapped: the column of the token greedy decoding
of :data:`MESSAGES` writes at step ``k`` and the column of ``<|end|>``. Its input side is
untouched, so greedy decoding now writes the same first ``k`` tokens and then ``<|end|>``:
the test knows exactly the reply the server must give and where it must stop.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.serve import ModelService, ServerThread
from jaxlab.tokenizer import ChatTemplate, Tokenizer, byte_tokenizer

OVERRIDES = [
    "tokenizer.kind=byte",
    "tokenizer.chat_tokens=true",
    "model.vocab_size=262",
    "inference.prefill_buckets=[32,128]",
    "inference.stream_chunk_tokens=4",
    "serve.slots=2",
    "serve.decode_groups=1",
    "serve.max_tokens_limit=64",
    "serve.prefill_chunk_tokens=32",
]
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "count: 3 4 5"},
]
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class ChatServer:
    srv: ServerThread
    tok: Tokenizer
    template: ChatTemplate
    reply_ids: list[int]  # what greedy decoding of MESSAGES writes before <|end|>

    @property
    def url(self) -> str:
        return self.srv.url + "/v1/chat/completions"

    @property
    def reply(self) -> str:
        return self.tok.decode(self.reply_ids)


def _greedy(graphdef: Any, params: Any, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``: the sequence forward over a fixed padded length
    (one compile; the model is causal, so the padding never reaches the last real row)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    width = 64

    @jax.jit
    def last_logits(params: Any, tokens: jax.Array, last: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        return model(tokens, jnp.arange(width)[None])[0, last]

    out = list(ids)
    for _ in range(n):
        tokens = np.zeros((1, width), np.int32)
        tokens[0, : len(out)] = out
        out.append(int(jnp.argmax(last_logits(params, tokens, len(out) - 1))))
    return out[len(ids) :]


@pytest.fixture(scope="module")
def chat() -> Iterator[ChatServer]:
    import jax.numpy as jnp

    from jaxlab.config import load_config
    from jaxlab.infer.engine import Engine
    from jaxlab.model import make_model, split_model

    cfg = load_config("tiny", OVERRIDES, environ={})
    tok = byte_tokenizer(chat=True)
    template = ChatTemplate(tok)
    prompt = template.render(MESSAGES, add_generation_prompt=True).ids
    model = make_model(cfg.model, cfg.train.precision, seed=0)
    graphdef, params = split_model(model)
    free = _greedy(graphdef, params, prompt, 8)
    # The first step k >= 3 whose token is new: swapping it with <|end|> moves no earlier step.
    k = next(i for i in range(3, 8) if free[i] not in free[:i])
    assert template.end_id not in free
    assert model.lm_head is not None  # the tiny preset's head is untied
    head = np.array(model.lm_head[...])
    head[:, [free[k], template.end_id]] = head[:, [template.end_id, free[k]]]
    model.lm_head[...] = jnp.asarray(head)
    graphdef, params = split_model(model)
    assert _greedy(graphdef, params, prompt, k + 1) == [*free[:k], template.end_id]
    service = ModelService.from_engine(Engine(graphdef, params, cfg), tok, cfg)
    srv = ServerThread(service).start()
    try:
        srv.wait_ready()
        yield ChatServer(srv, tok, template, free[:k])
    finally:
        srv.stop()


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "jaxlab", "messages": MESSAGES, "temperature": 0.0, **kw}


def sse_chunks(raw: str) -> list[dict[str, Any]]:
    """Strict SSE framing: ``data: `` lines, blank-line separated, ``[DONE]`` last."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    payloads = [b.removeprefix("data: ") for b in blocks]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def assert_error(r: httpx.Response, status: int, code: str, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == code and err["param"] == param, err
    return err["message"]


def test_the_reply_is_the_models_and_stops_at_end_of_turn(chat: ChatServer) -> None:
    doc = httpx.post(chat.url, json=body(), timeout=60).json()
    assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
    assert doc["model"] == "jaxlab" and isinstance(doc["created"], int)
    (choice,) = doc["choices"]
    assert choice["message"] == {"role": "assistant", "content": chat.reply}
    assert choice["finish_reason"] == "stop" and choice["index"] == 0
    prompt = chat.template.render(MESSAGES, add_generation_prompt=True).ids
    usage = doc["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == len(chat.reply_ids)  # <|end|> is not counted
    assert usage["total_tokens"] == len(prompt) + len(chat.reply_ids)
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)
    # The same conversation again: its prompt's full pages come from the prefix cache.
    again = httpx.post(chat.url, json=body(), timeout=60).json()
    assert again["choices"][0]["message"]["content"] == chat.reply
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_tokens_ends_the_reply_with_length(chat: ChatServer) -> None:
    doc = httpx.post(chat.url, json=body(max_tokens=2), timeout=60).json()
    assert doc["choices"][0]["message"]["content"] == chat.tok.decode(chat.reply_ids[:2])
    assert doc["choices"][0]["finish_reason"] == "length"
    # max_completion_tokens (OpenAI's newer name) means the same.
    same = httpx.post(chat.url, json=body(max_completion_tokens=2), timeout=60).json()
    assert same["choices"] == doc["choices"]


def test_streaming_sends_role_then_deltas_then_finish_then_done(chat: ChatServer) -> None:
    r = httpx.post(
        chat.url,
        json=body(stream=True, stream_options={"include_usage": True}),
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first, *middle, last, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in middle) and middle
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == chat.reply
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(chat.reply_ids)


def test_sampling_with_a_seed_repeats(chat: ChatServer) -> None:
    params = body(temperature=0.9, top_p=0.9, seed=11, max_tokens=12)
    a = httpx.post(chat.url, json=params, timeout=60).json()
    b = httpx.post(chat.url, json=params, timeout=60).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_stop_strings_cut_the_reply(chat: ChatServer) -> None:
    text = chat.reply
    cut = next((i for i in range(1, len(text)) if text[i].isprintable()), None)
    if cut is None:
        pytest.skip("the reply has no printable character to stop at")
    doc = httpx.post(chat.url, json=body(stop=[text[cut]]), timeout=60).json()
    assert doc["choices"][0]["message"]["content"] == text[: text.index(text[cut])]
    assert doc["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("patch", "status", "code", "param"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, 422, "invalid_value", "messages.0.role"),
        ({"messages": []}, 400, "invalid_value", "messages"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, 422, "invalid_value", None),
        ({"messages": [{"role": "user"}]}, 422, "missing", "messages.0.content"),
        ({"messages": None}, 422, "invalid_value", "messages"),
        ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
        (
            {"messages": [{"role": "user", "content": "x" * 200}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
        ({"max_tokens": 65}, 400, "max_tokens_exceeded", "max_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "invalid_value", None),
        ({"n": 2}, 400, "unsupported", "n"),
        ({"tools": [{"type": "function"}]}, 400, "unsupported", "tools"),
        ({"temperature": -1}, 400, "invalid_value", "temperature"),
    ],
)
def test_bad_requests_are_openai_shaped_4xx_naming_the_field(
    chat: ChatServer, patch: dict[str, Any], status: int, code: str, param: str | None
) -> None:
    r = httpx.post(chat.url, json=body(**patch), timeout=60)
    if param is None:  # the field is named in the message (pydantic's loc or ours)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and ("content" in err["message"] or "max_" in err["message"])
    else:
        assert_error(r, status, code, param)


def test_the_official_client_streams_and_not(chat: ChatServer) -> None:
    import openai

    client = openai.OpenAI(base_url=chat.srv.url + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(
        model="jaxlab",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
    )
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == chat.reply
    assert done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens == len(chat.reply_ids)
    stream = client.chat.completions.create(
        model="jaxlab",
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0.0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == chat.reply
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)  # type: ignore[arg-type]
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(
            model="jaxlab",
            messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}],
        )


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]) | _JSON,
        "content": st.text(max_size=40) | _JSON,
    }
)
_CHAT_BODY = st.fixed_dictionaries(
    {"messages": st.lists(_MESSAGE, max_size=3) | _JSON},
    optional={
        "model": st.just("jaxlab") | _JSON,
        "max_tokens": st.integers(1, 8) | _JSON,
        "stream": st.booleans() | _JSON,
        "temperature": st.floats(0, 2) | _JSON,
        "seed": st.integers(0, 100) | _JSON,
        "stop": st.text(min_size=1, max_size=3) | _JSON,
    },
)


@settings(max_examples=40, deadline=None)
@given(payload=_CHAT_BODY)
def test_no_chat_body_gets_a_5xx(chat: ChatServer, payload: dict[str, Any]) -> None:
    r = httpx.post(chat.url, json=payload, timeout=60)
    assert r.status_code < 500, (payload, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert all("error" not in c for c in sse_chunks(r.text))
    else:
        assert r.json()["object"] == "chat.completion"


@pytest.mark.slow
def test_a_chat_jsonl_fine_tune_answers_and_ends_its_turns(tmp_path: Path) -> None:
    """The whole chain: conversations -> a chat-jsonl run (loss on the replies only) -> a
    server whose greedy replies continue the count and end at <|end|>."""
    import openai

    from jaxlab.config import load_config
    from jaxlab.serve import serve_config
    from jaxlab.train.trainer import Trainer

    rng = random.Random(0)
    lines = []
    for _ in range(3000):
        a = rng.randint(0, 80)
        conv = [
            {"role": "user", "content": f"count: {a} {a + 1} {a + 2}"},
            {"role": "assistant", "content": f"{a + 3} {a + 4} {a + 5}"},
        ]
        lines.append(json.dumps({"messages": conv}))
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    cfg = load_config(
        "tiny",
        [
            "train.steps=200",
            "checkpoint.every_steps=200",
            "tokenizer.kind=byte",
            "tokenizer.chat_tokens=true",
            "model.vocab_size=262",
            "data.source=chat-jsonl",
            f"data.paths=['{tmp_path / 'chats.jsonl'}']",
            f"runtime.artifacts_dir={tmp_path}",
        ],
        environ={},
    )
    trainer = Trainer(cfg, tmp_path / "run")
    summary = trainer.run()
    trainer.close()
    assert summary.eval is not None and summary.eval["accuracy"] > 0.8
    served = serve_config(
        tmp_path / "run",
        [
            "serve.port=0",
            "serve.slots=2",
            "serve.decode_groups=1",
            "inference.prefill_buckets=[32]",
            "serve.prefill_chunk_tokens=32",
        ],
        environ={},
    )
    srv = ServerThread(ModelService.from_run_dir(served, tmp_path / "run")).start()
    try:
        srv.wait_ready(timeout_s=300)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        right = ended = 0
        for a in (5, 10, 33, 47, 70):
            done = client.chat.completions.create(
                model="jaxlab",
                messages=[{"role": "user", "content": f"count: {a} {a + 1} {a + 2}"}],
                temperature=0.0,
                max_tokens=20,
            )
            right += done.choices[0].message.content == f"{a + 3} {a + 4} {a + 5}"
            ended += done.choices[0].finish_reason == "stop"
    finally:
        srv.stop()
    assert right >= 4 and ended >= 4, (right, ended)
