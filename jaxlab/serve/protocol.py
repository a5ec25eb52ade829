"""The wire format: request bodies and their validation, OpenAI-shaped response and error
bodies.

Three request schemas:

- :class:`GenerateBody` (``POST /v1/generate``, native): unknown fields are errors.
- :class:`CompletionBody` (``POST /v1/completions``, the OpenAI subset): unknown fields
  are ignored (clients send ``user`` and the like), and OpenAI features jaxlab does not
  implement (``n > 1``, ``echo``, ``logprobs``, ``best_of``, ``suffix``, penalties,
  ``logit_bias``) are refused with 400 naming the parameter when set to a non-default.
- :class:`ChatCompletionBody` (``POST /v1/chat/completions``): the same rules, with
  ``messages`` (roles ``system``, ``user``, ``assistant``; string contents) for the prompt;
  tools, response formats and logprobs are refused the same way.

:func:`validate` checks a body in two steps: its shape (pydantic, strict types: 422 for a
wrong type, a missing or an unknown field), then its values (:meth:`Body.check`: 400
naming the field and its valid range). The numeric ranges are
:mod:`jaxlab.config.ranges`, the ones ``Request.create`` checks again, so the two never
disagree; the body's check only names the field as the client sent it.

Every error body is ``{"error": {"message", "type", "param", "code"}}``. Nothing here
knows the model, the scheduler or the domain errors (:mod:`jaxlab.serve.app` maps those).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxlab.config.ranges import (
    INT32_MAX,
    MAX_NEW_TOKENS,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Range,
    shown,
)

B = TypeVar("B", bound="Body")

MAX_SEED = INT32_MAX
MAX_STOP_STRINGS = 4

#: The numeric fields both endpoints share -> their valid range.
RANGES: dict[str, Range] = {
    "max_tokens": MAX_NEW_TOKENS,
    "temperature": TEMPERATURE,
    "top_k": TOP_K,
    "top_p": TOP_P,
    "seed": SEED,
}
#: OpenAI fields jaxlab does not implement -> the values it takes (their defaults).
UNSUPPORTED = {
    "n": (1,),
    "echo": (False,),
    "logprobs": (None,),
    "best_of": (None, 1),
    "suffix": (None,),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An error answered as JSON ``{"error": {...}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


class Body(BaseModel):
    """A request body: its shape is pydantic's, its values :meth:`check`'s."""

    def check(self) -> None:
        """Raise :class:`ApiError` 400 naming the first field whose value is invalid."""


class _Sampling(Body):
    """Fields both endpoints share. ``None`` means the server's default."""

    model_config = ConfigDict(strict=True)

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    def check(self) -> None:
        for name, valid in RANGES.items():
            value = getattr(self, name)
            problem = None if value is None else valid.problem(name, value)
            if problem is not None:
                raise _invalid(name, problem)
        self.stop_strings()

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})")
        if any(s == "" for s in stop):
            raise _invalid("stop", "stop strings must not be empty")
        return tuple(stop)


class GenerateBody(_Sampling):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


def _refuse_unsupported(body: BaseModel, unsupported: dict[str, tuple[Any, ...]]) -> None:
    """400 naming the first field of ``unsupported`` set to a value jaxlab does not take."""
    for name, takes in unsupported.items():
        value = getattr(body, name)
        if (value is None and None in takes) or any(value == v for v in takes if v is not None):
            continue
        raise ApiError(
            400,
            f"{name} = {shown(value)} is not supported by jaxlab serve; send "
            f"{' or '.join(json.dumps(v) for v in takes)}, or leave it out",
            param=name,
            code="unsupported",
        )


class CompletionBody(_Sampling):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | list[str]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def single_prompt(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) == 1:
            return self.prompt[0]
        raise ApiError(
            400,
            f"one prompt per request (got a list of {len(self.prompt)}); send one string",
            param="prompt",
            code="unsupported",
        )

    def check(self) -> None:
        super().check()
        _refuse_unsupported(self, UNSUPPORTED)


class ChatMessage(BaseModel):
    """One message; other fields OpenAI defines (``name``) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str


#: OpenAI chat fields jaxlab does not implement -> the values it takes.
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class ChatCompletionBody(_Sampling):
    model_config = ConfigDict(strict=True, extra="ignore")
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED

    model: str | None = None
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: OpenAI's newer name for ``max_tokens``; the two must agree when both are sent.
    max_completion_tokens: int | None = None
    n: int = 1
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def check(self) -> None:
        if not self.messages:
            raise _invalid("messages", "messages must hold at least one message (got [])")
        new = self.max_completion_tokens
        if new is not None:
            if self.max_tokens is not None and self.max_tokens != new:
                raise _invalid(
                    "max_completion_tokens",
                    f"max_completion_tokens = {new} disagrees with max_tokens = "
                    f"{self.max_tokens}; send one of them",
                )
            self.max_tokens = new
        super().check()
        _refuse_unsupported(self, self.unsupported)


def completion_doc(
    cid: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    """A ``text_completion`` with one choice (a whole answer, or one SSE chunk of it)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_completion_doc(
    cid: str, created: int, model: str, content: str, finish_reason: str | None
) -> dict[str, Any]:
    """A ``chat.completion``: one assistant message."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_chunk_doc(
    cid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    """A ``chat.completion.chunk``: the first carries the role, then content deltas, the
    last an empty delta and the finish reason."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_doc(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    speculation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V
    came from the prefix cache. With speculative decoding (``speculation``, from
    ``RequestStream.speculation``), also OpenAI's ``completion_tokens_details`` (drafted
    tokens accepted and rejected) and jaxlab's ``speculative`` object, which says whether
    speculation switched itself off for the request."""
    doc: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if speculation is not None:
        drafted, accepted = speculation["draft_tokens"], speculation["accepted_tokens"]
        doc["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
        doc["speculative"] = speculation
    return doc


def models_doc(names: Sequence[str]) -> dict[str, Any]:
    """``GET /v1/models``: the served models, the base first, then its LoRA adapters (each
    with ``parent``, the base, as vLLM lists them)."""
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "jaxlab"}
        | ({"parent": names[0]} if i else {})
        for i, name in enumerate(names)
    ]
    return {"object": "list", "data": data}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON (numbers must be finite)")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`ApiError` 400 for anything else: invalid
    JSON, ``NaN``/``Infinity`` (Python's parser takes them, JSON does not), a document
    nested too deeply for the parser, a body that is not an object."""
    try:
        data = json.loads(raw, parse_constant=_not_json)
    except (ValueError, UnicodeDecodeError) as e:
        why = str(e).split("; use sys.set_int_max_str_digits")[0]  # a hint for servers only
        raise ApiError(400, f"invalid JSON body: {why}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(
            400, "invalid JSON body: nested too deeply to parse", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(
            400, f"the body must be a JSON object (got {type(data).__name__})", code="invalid_json"
        )
    return data


def validate(model: type[B], data: dict[str, Any]) -> B:
    """``model`` from ``data``, then its :meth:`Body.check`. :class:`ApiError` 422 naming
    the first field of a wrong type, missing or unknown; 400 for a value out of range."""
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = errors[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in errors
        )
        code = "missing" if first["type"] == "missing" else "invalid_value"
        if first["type"] == "extra_forbidden":
            code = "unknown_field"
        raise ApiError(422, message, param=param, code=code) from None
    body.check()
    return body


__all__ = [
    "CHAT_UNSUPPORTED",
    "MAX_SEED",
    "MAX_STOP_STRINGS",
    "RANGES",
    "UNSUPPORTED",
    "ApiError",
    "Body",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "GenerateBody",
    "StreamOptions",
    "chat_chunk_doc",
    "chat_completion_doc",
    "completion_doc",
    "error_body",
    "models_doc",
    "parse_json",
    "usage_doc",
    "validate",
]
