"""The Starlette application: routes, auth, body limits, errors, SSE streaming.

Routes::

    GET  /health           200 while the process is alive
    GET  /ready            200 when the model is loaded and warmed, else 503
    GET  /metrics          Prometheus text (own registry)
    GET  /v1/models        the served model (OpenAI shape)
    POST /v1/generate      native: text, token ids and timings
    POST /v1/completions   OpenAI-compatible subset, ``stream`` = SSE

Every error is JSON ``{"error": {"message", "type", "param", "code"}}``; a client mistake
is never a 500 (a catch-all still answers JSON for real bugs).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxlab.serve.lifecycle import ModelState
from jaxlab.serve.protocol import (
    MAX_SEED,
    ApiError,
    CompletionBody,
    GenerateBody,
    _Sampling,
    error_body,
    parse_json,
    validate,
)
from jaxlab.serve.scheduler import Event, GenRequest, RequestHandle, ServeError
from jaxlab.serve.service import ModelService

log = logging.getLogger("jaxlab.serve")

Handler = Callable[[Request], Awaitable[Response]]

#: Paths counted in ``jaxlab_requests_total{status}``.
GENERATION_PATHS = frozenset({"/v1/generate", "/v1/completions"})
#: Set on the ASGI scope when a stream ended badly after its 200 header was sent.
OUTCOME_KEY = "jaxlab.outcome"
CLIENT_GONE = 499


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _from_serve_error(e: ServeError) -> ApiError:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
    return ApiError(e.status, e.message, code=e.code, headers=headers)


# ----------------------------------------------------------------------------- middleware


class V1Middleware:
    """API-key check for ``/v1/*`` and the per-status request counter (pure ASGI)."""

    def __init__(self, app: ASGIApp, service: ModelService) -> None:
        self.app = app
        self.service = service
        key = service.serve_cfg.api_key
        self._key = key.get_secret_value().encode() if key is not None else None

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
                await _error_response(err)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if counted:
                code = scope.get(OUTCOME_KEY) or status.get("code", 500)
                self.service.metrics.requests.labels(status=str(code)).inc()


# ----------------------------------------------------------------------------- helpers


async def read_body(request: Request, limit: int) -> bytes:
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


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _next_event(h: RequestHandle, watcher: asyncio.Future[None], timeout_s: float) -> Event:
    """The next event of ``h``; :class:`ClientGone` if the client leaves first."""
    get = asyncio.ensure_future(h.next())
    done, _ = await asyncio.wait(
        {get, watcher}, timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED
    )
    if get in done:
        return get.result()
    get.cancel()
    h.cancel()
    if watcher in done:
        raise ClientGone
    # The scheduler enforces the deadline; this is only a safety net.
    raise ApiError(504, "request timed out", code="timeout")


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
    import json

    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ----------------------------------------------------------------------------- the app


class ServeApp:
    """Request handlers bound to one :class:`ModelService`."""

    def __init__(self, service: ModelService) -> None:
        self.service = service
        self.cfg = service.serve_cfg
        self.inf = service.cfg.inference

    # ---------------------------------------------------------------- plain routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "state": str(self.service.state)})

    async def ready(self, request: Request) -> Response:
        info = self.service.info()
        ok = self.service.state == ModelState.READY
        body = {"ready": ok, **info}
        if self.service.lifecycle.error:
            body["error"] = self.service.lifecycle.error
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.service.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "jaxlab",
                    }
                ],
            }
        )

    # ---------------------------------------------------------------- generation

    def _request(self, prompt: str, p: _Sampling) -> tuple[GenRequest, int]:
        from jaxlab.infer.engine import BadRequest, RequestTooLong
        from jaxlab.infer.sampling import SamplingParams

        engine = self.service.engine
        if engine is None or self.service.state != ModelState.READY:
            raise _from_serve_error(
                ServeError(
                    503,
                    f"the model is not ready (state: {self.service.state})",
                    code="draining" if self.service.state == ModelState.DRAINING else "not_ready",
                    retry_after_s=5.0,
                )
            )
        limit = self.cfg.max_tokens_limit
        max_tokens = (
            p.max_tokens if p.max_tokens is not None else min(self.inf.max_new_tokens, limit)
        )
        if max_tokens > limit:
            raise ApiError(
                400,
                f"max_tokens = {max_tokens} exceeds serve.max_tokens_limit = {limit}",
                param="max_tokens",
                code="max_tokens_exceeded",
            )
        seed = p.seed if p.seed is not None else secrets.randbelow(MAX_SEED + 1)
        sampling = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.inf.temperature if p.temperature is None else p.temperature,
            top_k=self.inf.top_k if p.top_k is None else p.top_k,
            top_p=self.inf.top_p if p.top_p is None else p.top_p,
            seed=seed,
            ignore_eos=p.ignore_eos,
        )
        ids = engine.encode(prompt)
        try:
            engine.check_request(ids, sampling)
        except RequestTooLong as e:
            raise ApiError(400, str(e), param="prompt", code="context_length_exceeded") from None
        except BadRequest as e:
            raise ApiError(400, str(e), code="invalid_request") from None
        return GenRequest(ids, sampling, p.stop_strings()), seed

    def _submit(self, req: GenRequest, stream: bool) -> RequestHandle:
        try:
            return self.service.submit(req, loop=asyncio.get_running_loop(), stream=stream)
        except ServeError as e:
            raise _from_serve_error(e) from None

    def _deadline_s(self) -> float:
        return self.cfg.request_timeout_s + 5.0

    async def _complete(self, request: Request, req: GenRequest) -> RequestHandle | None:
        """Run ``req`` to its end (non-streaming): the finished handle, or None when the
        client left first (the request is cancelled). A failed request raises its API error.
        """
        h = self._submit(req, stream=False)
        watcher = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            t_end = time.perf_counter() + self._deadline_s()
            while True:
                try:
                    ev = await _next_event(h, watcher, t_end - time.perf_counter())
                except ClientGone:
                    request.scope[OUTCOME_KEY] = CLIENT_GONE
                    return None
                if ev.kind != "tokens":
                    break
        finally:
            watcher.cancel()
        if ev.kind == "error":
            assert ev.error is not None
            raise _from_serve_error(ev.error)
        return h

    async def generate(self, request: Request) -> Response:
        body = validate(GenerateBody, parse_json(await read_body(request, self.cfg.max_body_bytes)))
        req, seed = self._request(body.prompt, body)
        h = await self._complete(request, req)
        if h is None:
            return Response(status_code=CLIENT_GONE)
        eng = self.service.engine
        assert eng is not None
        return JSONResponse(
            {
                "text": h.output_text,
                "token_ids": h.token_ids,
                "finish_reason": h.finish_reason,
                "prompt_tokens": len(req.prompt_ids),
                "generated_tokens": len(h.token_ids),
                "prefill_s": h.prefill_s,
                "decode_s": h.decode_s,
                "total_s": h.total_s,
                "ttft_s": h.ttft_s,
                "tokens_per_s": h.tokens_per_s,
                "queue_s": h.queue_s,
                "seed": seed,
                "model": self.service.model_name,
                "checkpoint_step": eng.checkpoint_step,
                "platform": eng.platform,
                "precision": eng.precision,
            }
        )

    async def completions(self, request: Request) -> Response:
        body = validate(
            CompletionBody, parse_json(await read_body(request, self.cfg.max_body_bytes))
        )
        if body.model is not None and body.model != self.service.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves "
                f"{self.service.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        body.check_supported()
        prompt = body.single_prompt()
        req, _ = self._request(prompt, body)
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = self.service.model_name
        n_prompt = len(req.prompt_ids)

        def usage(h: RequestHandle) -> dict[str, int]:
            n = len(h.token_ids)
            return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }

        if not body.stream:
            h = await self._complete(request, req)
            if h is None:
                return Response(status_code=CLIENT_GONE)
            doc = chunk(h.output_text, h.finish_reason)
            doc["usage"] = usage(h)
            return JSONResponse(doc)

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        h = self._submit(req, stream=True)
        # Wait for the first event before sending the 200 header, so that an error while
        # queued (timeout, shutdown) is still a real HTTP status.
        watcher = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            first = await _next_event(h, watcher, self._deadline_s())
        except ClientGone:
            request.scope[OUTCOME_KEY] = CLIENT_GONE
            return Response(status_code=CLIENT_GONE)
        finally:
            watcher.cancel()
        if first.kind == "error":
            assert first.error is not None
            raise _from_serve_error(first.error)
        scope = request.scope

        async def events() -> AsyncIterator[str]:
            ev = first
            t_end = h.t_arrival + self._deadline_s()
            while True:
                if ev.kind == "tokens":
                    if ev.text:
                        yield sse(chunk(ev.text, None))
                elif ev.kind == "done":
                    yield sse(chunk("", ev.finish_reason))
                    if include_usage:
                        yield sse({**chunk("", None), "choices": [], "usage": usage(h)})
                    yield SSE_DONE
                    return
                else:
                    assert ev.error is not None
                    scope[OUTCOME_KEY] = ev.error.status
                    yield sse(error_body(ev.error.status, ev.error.message, code=ev.error.code))
                    yield SSE_DONE
                    return
                try:
                    ev = await asyncio.wait_for(h.next(), max(t_end - time.perf_counter(), 0.0))
                except TimeoutError:
                    h.cancel()
                    scope[OUTCOME_KEY] = 504
                    yield sse(error_body(504, "request timed out", code="timeout"))
                    yield SSE_DONE
                    return

        def on_close() -> None:
            if not h.finished:
                h.cancel()
                scope.setdefault(OUTCOME_KEY, CLIENT_GONE)

        return SSEResponse(events(), on_close)


# ----------------------------------------------------------------------------- errors


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), code=code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s: %r", request.method, request.url.path, exc)
    return JSONResponse(
        error_body(500, f"internal server error: {type(exc).__name__}", code="internal_error"),
        status_code=500,
    )


def create_app(service: ModelService, *, manage_service: bool = True) -> Starlette:
    """The ASGI app for ``service``. With ``manage_service`` the app's lifespan starts the
    service (engine thread) at startup and stops it at shutdown."""
    from starlette.middleware import Middleware

    h = ServeApp(service)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_service:
            service.start()
        try:
            yield
        finally:
            if manage_service:
                await asyncio.get_running_loop().run_in_executor(None, service.stop)

    routes: list[tuple[str, Handler, list[str]]] = [
        ("/health", h.health, ["GET"]),
        ("/ready", h.ready, ["GET"]),
        ("/metrics", h.metrics, ["GET"]),
        ("/v1/models", h.models, ["GET"]),
        ("/v1/generate", h.generate, ["POST"]),
        ("/v1/completions", h.completions, ["POST"]),
    ]
    app = Starlette(
        routes=[Route(path, fn, methods=methods) for path, fn, methods in routes],
        middleware=[Middleware(V1Middleware, service=service)],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.service = service
    return app


__all__ = ["GENERATION_PATHS", "ServeApp", "V1Middleware", "create_app", "read_body"]
