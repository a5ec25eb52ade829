"""The ASGI plumbing under the routes: the ``/v1`` middleware, body limits, disconnects, SSE.

- :class:`V1Middleware` checks the API key on ``/v1/*`` (401) and counts every generation
  request by the status it answered (``jaxlab_requests_total{status}``), including a
  stream that failed after its 200 header (:data:`OUTCOME_KEY`) or a client that left
  (:data:`CLIENT_GONE`).
- :func:`read_body` reads a body of at most ``serve.max_body_bytes`` (413).
- :func:`until_disconnect` and :class:`SSEResponse` let a handler notice a client that
  went away, before and during a stream; :func:`client_gone` answers one that left
  (:class:`ClientGone`, or Starlette's ``ClientDisconnect`` while its body was read).

Nothing here knows requests, the model or the domain errors (:mod:`jaxlab.serve.app`
maps those).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.protocol import ApiError

#: Paths counted in ``jaxlab_requests_total{status}``.
GENERATION_PATHS = frozenset({"/v1/generate", "/v1/completions"})
#: Set on the ASGI scope when a stream ended badly after its 200 header was sent.
OUTCOME_KEY = "jaxlab.outcome"
CLIENT_GONE = 499

log = logging.getLogger("jaxlab.serve")


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


# ----------------------------------------------------------------------------- middleware


class V1Middleware:
    """API-key check for ``/v1/*`` and the per-status request counter (pure ASGI)."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics
        self._key = api_key.encode() if api_key is not None else None

    def _authorized(self, scope: Scope) -> bool:
        if self._key is None:
            return True
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        counted = scope["path"] in GENERATION_PATHS and scope["method"] == "POST"
        status: dict[str, int] = {}

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if not self._authorized(scope):
                err = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <serve.api_key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(err)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if counted:
                code = scope.get(OUTCOME_KEY) or status.get("code", 500)
                self.metrics.requests.labels(status=str(code)).inc()


# ----------------------------------------------------------------------------- helpers


async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The request body, or 413 if it is (or claims to be) over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header", code="invalid_header") from None
        if n > limit:
            raise ApiError(
                413,
                f"request body of {n} bytes exceeds serve.max_body_bytes = {limit}",
                code="request_too_large",
            )
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413,
                f"request body exceeds serve.max_body_bytes = {limit}",
                code="request_too_large",
            )
    return bytes(body)


async def until_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def mark_gone(scope: Scope) -> None:
    """Count the request as a client that left, 499 (nginx's "client closed request"), and
    log it on one line: a client going away is not a server error, so no traceback."""
    scope[OUTCOME_KEY] = CLIENT_GONE
    log.info("%s %s: the client disconnected (%d)", scope["method"], scope["path"], CLIENT_GONE)


async def client_gone(request: HttpRequest, exc: Exception) -> Response:
    """The exception handler for a client that disconnected before its body was read or
    before its answer was ready (:func:`mark_gone`). The 499 it answers reaches nobody."""
    mark_gone(request.scope)
    return Response(status_code=CLIENT_GONE)


class SSEResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


__all__ = [
    "CLIENT_GONE",
    "GENERATION_PATHS",
    "OUTCOME_KEY",
    "SSE_DONE",
    "ClientGone",
    "SSEResponse",
    "V1Middleware",
    "client_gone",
    "error_response",
    "mark_gone",
    "read_body",
    "sse",
    "until_disconnect",
]
