"""The wire format: request bodies and their validation, OpenAI-shaped response and error
bodies.

Two request schemas:

- :class:`GenerateBody` (``POST /v1/generate``, native): unknown fields are errors.
- :class:`CompletionBody` (``POST /v1/completions``, the OpenAI subset): unknown fields
  are ignored (clients send ``user`` and the like), and OpenAI features jaxlab does not
  implement (``n > 1``, ``echo``, ``logprobs``, ``best_of``, ``suffix``, penalties,
  ``logit_bias``) are refused with 400 naming the parameter when set to a non-default.

Every error body is ``{"error": {"message", "type", "param", "code"}}``. Nothing here
knows the model, the scheduler or the domain errors (:mod:`jaxlab.serve.app` maps those).
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_SEED = 2**31 - 1  # as jaxlab.infer.sampling.MAX_SEED (kept jax-free here)
MAX_STOP_STRINGS = 4

M = TypeVar("M", bound=BaseModel)

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


class _Sampling(BaseModel):
    """Fields both endpoints share. ``None`` means the server's default."""

    model_config = ConfigDict(strict=True)

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(
                400,
                f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})",
                param="stop",
                code="invalid_value",
            )
        if any(s == "" for s in stop):
            raise ApiError(
                400, "stop strings must not be empty", param="stop", code="invalid_value"
            )
        return tuple(stop)


class GenerateBody(_Sampling):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


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

    def check_supported(self) -> None:
        unsupported = {
            "n": self.n != 1,
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "best_of": self.best_of not in (None, 1),
            "suffix": self.suffix is not None,
            "presence_penalty": self.presence_penalty not in (None, 0.0),
            "frequency_penalty": self.frequency_penalty not in (None, 0.0),
            "logit_bias": bool(self.logit_bias),
        }
        for name, bad in unsupported.items():
            if bad:
                raise ApiError(
                    400,
                    f"{name} is not supported by jaxlab serve (got {getattr(self, name)!r})",
                    param=name,
                    code="unsupported",
                )


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


def usage_doc(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def models_doc(name: str) -> dict[str, Any]:
    """``GET /v1/models``: the one served model."""
    model = {"id": name, "object": "model", "created": 0, "owned_by": "jaxlab"}
    return {"object": "list", "data": [model]}


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`ApiError` 400."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(
            400, f"the body must be a JSON object (got {type(data).__name__})", code="invalid_json"
        )
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """``model`` from ``data``, or :class:`ApiError` 422 naming the first bad field."""
    try:
        return model.model_validate(data)
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


__all__ = [
    "MAX_STOP_STRINGS",
    "ApiError",
    "CompletionBody",
    "GenerateBody",
    "StreamOptions",
    "completion_doc",
    "error_body",
    "models_doc",
    "parse_json",
    "usage_doc",
    "validate",
]
