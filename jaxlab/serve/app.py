"""The Starlette application: the routes, and the one mapping of errors to HTTP statuses.

Routes::

    GET  /health           200 while the process is alive
    GET  /ready            200 when the model is loaded and warmed, else 503
    GET  /metrics          Prometheus text (own registry)
    GET  /v1/models        the served models: the base and each LoRA adapter (OpenAI shape)
    POST /v1/generate      native: text, token ids and timings
    POST /v1/completions   OpenAI-compatible subset, ``stream`` = SSE
    POST /v1/chat/completions  the same for conversations (the chat template's prompt)

HTTP only (its ASGI plumbing is :mod:`jaxlab.serve.asgi`): the service (:mod:`jaxlab.serve.service`) checks and queues requests, and
their :class:`~jaxlab.serve.output.RequestStream` delivers the results. This module is the
one place that maps errors to HTTP statuses (:func:`api_error`): the domain errors of
:mod:`jaxlab.serve.errors` and the request errors of ``Request.create``. Every error is
JSON ``{"error": {"message", "type", "param", "code"}}``; a client mistake is never a 500
(a catch-all still answers JSON for real bugs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxlab.serve.asgi import (
    CLIENT_GONE,
    OUTCOME_KEY,
    SSE_DONE,
    ClientGone,
    SSEResponse,
    V1Middleware,
    client_gone,
    error_response,
    mark_gone,
    read_body,
    sse,
    until_disconnect,
)
from jaxlab.serve.errors import (
    Cancelled,
    NotAccepting,
    QueueFull,
    RequestTimeout,
    ServeError,
    ShuttingDown,
)
from jaxlab.serve.lifecycle import ModelState
from jaxlab.serve.output import Event, RequestStream
from jaxlab.serve.protocol import (
    MAX_SEED,
    ApiError,
    ChatCompletionBody,
    CompletionBody,
    GenerateBody,
    _Sampling,
    chat_chunk_doc,
    chat_completion_doc,
    completion_doc,
    error_body,
    models_doc,
    parse_json,
    usage_doc,
    validate,
)
from jaxlab.serve.service import ModelService

if TYPE_CHECKING:
    from jaxlab.infer.request import Request

log = logging.getLogger("jaxlab.serve")

Handler = Callable[[HttpRequest], Awaitable[Response]]


def api_error(e: Exception) -> ApiError:
    """The HTTP answer to a domain or request error (the module docstring's one place)."""
    if isinstance(e, ServeError):
        if isinstance(e, QueueFull):
            return ApiError(503, e.message, code="queue_full", headers={"Retry-After": "1"})
        if isinstance(e, NotAccepting):
            code = "draining" if e.state == ModelState.DRAINING else "not_ready"
            return ApiError(503, e.message, code=code, headers={"Retry-After": "5"})
        if isinstance(e, ShuttingDown):
            return ApiError(503, e.message, code="shutting_down")
        if isinstance(e, RequestTimeout):
            return ApiError(504, e.message, code="timeout")
        if isinstance(e, Cancelled):
            return ApiError(CLIENT_GONE, e.message, code="cancelled")
        return ApiError(500, e.message, code="internal_error")  # EngineFailure
    # Only a loaded model raises these, so jax is imported by now.
    from jaxlab.infer.request import RequestError, RequestTooLong

    if isinstance(e, RequestTooLong):
        return ApiError(400, str(e), param=e.param, code="context_length_exceeded")
    if isinstance(e, RequestError):
        return ApiError(400, str(e), param=e.param, code="invalid_request")
    raise e


async def _next_event(h: RequestStream, watcher: asyncio.Future[None], timeout_s: float) -> Event:
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


# ----------------------------------------------------------------------------- the app


class ServeApp:
    """Request handlers bound to one :class:`ModelService`."""

    def __init__(self, service: ModelService) -> None:
        self.service = service
        self.cfg = service.serve_cfg
        self.inf = service.cfg.inference

    # ---------------------------------------------------------------- plain routes

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "state": str(self.service.state)})

    async def ready(self, request: HttpRequest) -> Response:
        info = self.service.info()
        ok = self.service.state == ModelState.READY
        body = {"ready": ok, **info}
        if self.service.lifecycle.error:
            body["error"] = self.service.lifecycle.error
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: HttpRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse(models_doc(self.service.model_names))

    # ---------------------------------------------------------------- generation

    def _request(
        self,
        prompt: str | list[int],
        p: _Sampling,
        stop_token_ids: tuple[int, ...] = (),
        *,
        model: str | None = None,
    ) -> tuple[Request, int]:
        """The checked request for ``prompt`` (text, or token ids) with the body's sampling
        (server defaults for what it leaves out) and ``stop_token_ids``, run by ``model``
        (a name :meth:`served_model` resolved; None: the base), and its seed."""
        from jaxlab.infer.sampling import SamplingParams

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
            stop_token_ids=stop_token_ids,
            ignore_eos=p.ignore_eos,
        )
        try:
            adapter = 0 if model is None else self.service.adapter_id(model) or 0
            return self.service.request(prompt, sampling, p.stop_strings(), adapter=adapter), seed
        except (ServeError, ValueError) as e:  # RequestError is a ValueError
            raise api_error(e) from None

    def _submit(self, req: Request, stream: bool) -> RequestStream:
        return self.service.submit(req, loop=asyncio.get_running_loop(), stream=stream)

    def _deadline_s(self) -> float:
        return self.cfg.request_timeout_s + 5.0

    async def _complete(self, request: HttpRequest, req: Request) -> RequestStream:
        """Run ``req`` to its end (non-streaming): the finished handle. A failed request
        raises its API error; a client that left first, :class:`ClientGone` (the request
        is cancelled)."""
        h = self._submit(req, stream=False)
        watcher = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            t_end = time.perf_counter() + self._deadline_s()
            while True:
                ev = await _next_event(h, watcher, t_end - time.perf_counter())
                if ev.kind != "tokens":
                    break
        finally:
            watcher.cancel()
        if ev.kind == "error":
            assert ev.error is not None
            raise api_error(ev.error)
        return h

    async def generate(self, request: HttpRequest) -> Response:
        body = validate(GenerateBody, parse_json(await read_body(request, self.cfg.max_body_bytes)))
        req, seed = self._request(body.prompt, body)
        h = await self._complete(request, req)
        model = self.service.model
        assert model is not None
        eng = model.engine
        extra = {} if h.speculation is None else {"speculative": h.speculation}
        return JSONResponse(
            {
                **extra,
                "text": h.output_text,
                "token_ids": h.token_ids,
                "finish_reason": h.finish_reason,
                "prompt_tokens": len(req.prompt_ids),
                "cached_tokens": h.cached_tokens,
                "generated_tokens": len(h.token_ids),
                "prefill_s": h.prefill_s,
                "decode_s": h.decode_s,
                "total_s": h.total_s,
                "ttft_s": h.ttft_s,
                "tokens_per_s": h.tokens_per_s,
                "queue_s": h.queue_s,
                "seed": seed,
                "model": self.service.model_name,
                "checkpoint_step": model.checkpoint_step,
                "platform": eng.platform,
                "precision": eng.precision,
            }
        )

    def served_model(self, requested: str | None) -> str:
        """The model a request's ``model`` names (None: the base model): the base or one of
        its LoRA adapters, or 404 ``model_not_found``. The one place a request's ``model``
        is resolved."""
        if requested is None:
            return self.service.model_name
        if self.service.adapter_id(requested) is None:
            served = ", ".join(repr(n) for n in self.service.model_names)
            raise ApiError(
                404,
                f"model {requested!r} does not exist; this server serves {served} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return requested

    async def completions(self, request: HttpRequest) -> Response:
        body = validate(
            CompletionBody, parse_json(await read_body(request, self.cfg.max_body_bytes))
        )
        model = self.served_model(body.model)
        prompt = body.single_prompt()
        req, _ = self._request(prompt, body, model=model)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return completion_doc(cid, created, model, text, finish)

        if not body.stream:
            h = await self._complete(request, req)
            doc = chunk(h.output_text, h.finish_reason)
            doc["usage"] = _usage(req, h)
            return JSONResponse(doc)
        return await self._stream(
            request,
            req,
            opening=[],
            text=lambda text: chunk(text, None),
            end=lambda reason: chunk("", reason),
            usage=(
                (lambda h: {**chunk("", None), "choices": [], "usage": _usage(req, h)})
                if body.stream_options and body.stream_options.include_usage
                else None
            ),
        )

    async def chat_completions(self, request: HttpRequest) -> Response:
        from jaxlab.tokenizer.chat import ChatTemplate, NoChatTokens

        body = validate(
            ChatCompletionBody, parse_json(await read_body(request, self.cfg.max_body_bytes))
        )
        model = self.served_model(body.model)
        served = self.service.model
        if served is None:
            raise api_error(NotAccepting(str(self.service.state)))
        try:
            template = ChatTemplate(served.tokenizer)
        except NoChatTokens as e:
            raise ApiError(
                400,
                f"model {model!r} cannot chat: {e}",
                param="model",
                code="chat_template_unavailable",
            ) from None
        messages = [m.model_dump(include={"role", "content"}) for m in body.messages]
        prompt = template.render(messages, add_generation_prompt=True).ids
        try:
            req, _ = self._request(prompt, body, stop_token_ids=(template.end_id,), model=model)
        except ApiError as e:
            if e.param == "prompt":  # the rendered conversation is the prompt
                e.param = "messages"
            raise
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            return chat_chunk_doc(cid, created, model, delta, finish)

        if not body.stream:
            h = await self._complete(request, req)
            doc = chat_completion_doc(cid, created, model, h.output_text, h.finish_reason)
            doc["usage"] = _usage(req, h)
            return JSONResponse(doc)
        return await self._stream(
            request,
            req,
            opening=[chunk({"role": "assistant", "content": ""}, None)],
            text=lambda text: chunk({"content": text}, None),
            end=lambda reason: chunk({}, reason),
            usage=(
                (lambda h: {**chunk({}, None), "choices": [], "usage": _usage(req, h)})
                if body.stream_options and body.stream_options.include_usage
                else None
            ),
        )

    async def _stream(
        self,
        request: HttpRequest,
        req: Request,
        *,
        opening: list[dict[str, Any]],
        text: Callable[[str], dict[str, Any]],
        end: Callable[[str | None], dict[str, Any]],
        usage: Callable[[RequestStream], dict[str, Any]] | None,
    ) -> Response:
        """``req`` as SSE: the ``opening`` chunks, a ``text`` chunk per new text, the
        ``end`` chunk with the finish reason, the ``usage`` chunk if asked for, then
        ``[DONE]``. An error mid-stream is an error object, then ``[DONE]``."""
        h = self._submit(req, stream=True)
        # Wait for the first event before sending the 200 header, so that an error while
        # queued (timeout, shutdown) is still a real HTTP status.
        watcher = asyncio.ensure_future(until_disconnect(request.receive))
        try:
            first = await _next_event(h, watcher, self._deadline_s())
        finally:
            watcher.cancel()
        if first.kind == "error":
            assert first.error is not None
            raise api_error(first.error)
        scope = request.scope

        async def events() -> AsyncIterator[str]:
            for doc in opening:
                yield sse(doc)
            ev = first
            t_end = h.t_arrival + self._deadline_s()
            while True:
                if ev.kind == "tokens":
                    if ev.text:
                        yield sse(text(ev.text))
                elif ev.kind == "done":
                    yield sse(end(ev.finish_reason))
                    if usage is not None:
                        yield sse(usage(h))
                    yield SSE_DONE
                    return
                else:
                    assert ev.error is not None
                    err = api_error(ev.error)
                    scope[OUTCOME_KEY] = err.status
                    yield sse(err.body())
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
                if OUTCOME_KEY not in scope:
                    mark_gone(scope)

        return SSEResponse(events(), on_close)


def _usage(req: Request, h: RequestStream) -> dict[str, Any]:
    return usage_doc(len(req.prompt_ids), len(h.token_ids), h.cached_tokens, h.speculation)


# ----------------------------------------------------------------------------- errors


async def _api_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _serve_error(request: HttpRequest, exc: Exception) -> Response:
    return error_response(api_error(exc))


async def _http_error(request: HttpRequest, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), code=code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _internal_error(request: HttpRequest, exc: Exception) -> Response:
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
    key = service.serve_cfg.api_key
    api_key = key.get_secret_value() if key is not None else None

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
        ("/v1/chat/completions", h.chat_completions, ["POST"]),
    ]
    app = Starlette(
        routes=[Route(path, fn, methods=methods) for path, fn, methods in routes],
        middleware=[Middleware(V1Middleware, api_key=api_key, metrics=service.metrics)],
        exception_handlers={
            ApiError: _api_error,
            ServeError: _serve_error,
            HTTPException: _http_error,
            ClientGone: client_gone,  # the client left: 499, one log line
            ClientDisconnect: client_gone,  # ... while its body was being read
            Exception: _internal_error,
        },
        lifespan=lifespan,
    )
    app.state.service = service
    return app


__all__ = ["ServeApp", "api_error", "create_app"]
