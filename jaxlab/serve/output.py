"""One request's output: its text, stop strings, timings and metrics, and the caller's events.

:class:`RequestStream` is both ends of one request's results. The scheduler feeds it
token ids on the engine thread (it is the request's
:class:`~jaxlab.serve.scheduler.Output`); it detokenises them
(:class:`~jaxlab.tokenizer.Detokenizer`), leaves out the stop token that ended the row,
matches stop strings on the text and, when one matches, answers the scheduler that the
request is finished, so its slot is freed at once. It times the request (queue, TTFT,
decode, total), observes the per-request metrics, and hands the caller
:class:`Event` objects through an ``asyncio.Queue`` (fed with ``call_soon_threadsafe``)
or, for synchronous callers, a ``queue.Queue``.

It never touches the device or the scheduler's slots, and knows no HTTP: errors arrive
as :class:`~jaxlab.serve.errors.ServeError` objects, for the app to map.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from jaxlab.serve.errors import ServeError
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.tokenizer.detok import Detokenizer

if TYPE_CHECKING:
    from jaxlab.infer.request import Request
    from jaxlab.tokenizer import Tokenizer

EventKind = Literal["tokens", "done", "error"]
FinishReason = Literal["stop", "length"]


@dataclass
class Event:
    """What the caller receives: new text and token ids (``tokens``, streaming requests
    only), the end (``done``, with the finish reason) or a failure (``error``)."""

    kind: EventKind
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: ServeError | None = None


class RequestStream:
    """The output of one request (module docstring).

    Args:
      request: the checked request (its stop tokens and stop strings are used here).
      tokenizer: detokenises the generated ids.
      metrics: per-request histograms and token counters are observed on it.
      loop: the caller's event loop (events go to an ``asyncio.Queue``, read with
        :meth:`next`); None: a ``queue.Queue``, read with :meth:`get`.
      stream: emit a ``tokens`` event per batch of new tokens; otherwise only the end.
      model: the ``model`` the request named (the base or a LoRA adapter): the label of
        its per-model token counters.

    Timestamps are ``time.perf_counter()`` values; the durations are seconds.
    """

    def __init__(
        self,
        request: Request,
        tokenizer: Tokenizer,
        *,
        metrics: ServeMetrics,
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = False,
        model: str = "",
    ) -> None:
        self.request = request
        self.model = model
        self.stream = stream
        self.metrics = metrics
        self.text = Detokenizer(tokenizer, request.stop)
        self._loop = loop
        self._aq: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue[Event] | None = None if loop is not None else queue.Queue()
        self._cancel: Callable[[], None] | None = None
        self.finished = False
        self.finish_reason: FinishReason | None = None
        self.error: ServeError | None = None
        self.token_ids: list[int] = []
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        # Speculative decoding (None: the engine does not speculate).
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.speculating: bool | None = None
        self.t_arrival = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None

    # ------------------------------------------------------------------ the caller's side

    def on_cancel(self, cancel: Callable[[], None]) -> None:
        """What :meth:`cancel` calls (the service binds the scheduler's cancel)."""
        self._cancel = cancel

    async def next(self) -> Event:
        assert self._aq is not None, "made without an event loop: use get()"
        return await self._aq.get()

    def get(self, timeout: float | None = None) -> Event:
        """Blocking variant of :meth:`next` for synchronous callers."""
        assert self._q is not None, "made with an event loop: use next()"
        return self._q.get(timeout=timeout)

    def cancel(self) -> None:
        """Stop this request (no-op once it ended); its slot is freed by the scheduler."""
        if not self.finished and self._cancel is not None:
            self._cancel()

    @property
    def output_text(self) -> str:
        return self.text.text

    @property
    def queue_s(self) -> float:
        return (self.t_admit or self.t_arrival) - self.t_arrival

    @property
    def prefill_s(self) -> float:
        """Admission to the first token on the host (the prefill and its insert)."""
        if self.t_admit is None or self.t_first is None:
            return 0.0
        return self.t_first - self.t_admit

    @property
    def ttft_s(self) -> float:
        return (self.t_first - self.t_arrival) if self.t_first is not None else float("nan")

    @property
    def decode_s(self) -> float:
        if self.t_first is None or self.t_end is None:
            return float("nan")
        return self.t_end - self.t_first

    @property
    def total_s(self) -> float:
        return (self.t_end or time.perf_counter()) - self.t_arrival

    @property
    def tokens_per_s(self) -> float:
        t = self.total_s
        return len(self.token_ids) / t if t > 0 else float("nan")

    # ------------------------------------------------------------------ the scheduler's side

    def admitted(self, cached_tokens: int = 0) -> None:
        self.cached_tokens = cached_tokens
        self.t_admit = time.perf_counter()
        self.metrics.queue_time.observe(self.t_admit - self.t_arrival)
        self.metrics.prompt_tokens.inc(len(self.request.prompt_ids))
        self.metrics.model_prompt_tokens.labels(model=self.model).inc(len(self.request.prompt_ids))

    def speculated(self, drafted: int, accepted: int, on: bool) -> None:
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.speculating = on

    @property
    def speculation(self) -> dict[str, int | bool] | None:
        """Drafted and accepted tokens, and whether speculation switched itself off for
        this request (its acceptance was too low to pay); None without speculation."""
        if self.speculating is None:
            return None
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "switched_off": not self.speculating,
        }

    def emit(self, tokens: list[int], done: bool) -> bool:
        """Take this round's tokens; True when the request is finished (``done``, a stop
        string matched, or nobody is listening any more)."""
        if self.finished:
            return True
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.metrics.ttft.observe(now - self.t_arrival)
        fresh = list(tokens)
        by_token = done and bool(fresh) and fresh[-1] in self.request.stop_ids
        if by_token:
            fresh.pop()  # the stop token ends the request; it is never returned
        kept: list[int] = []
        delta = ""
        for t in fresh:
            kept.append(t)
            delta += self.text.feed(t)
            if self.text.stopped:
                break  # what follows a stop string is dropped
        self.token_ids.extend(kept)
        self.metrics.generation_tokens.inc(len(kept))
        self.metrics.model_generation_tokens.labels(model=self.model).inc(len(kept))
        reason: FinishReason | None = None
        if self.text.stopped or by_token:
            reason = "stop"
        elif done:
            reason = "length"
        if reason is not None:
            delta += self.text.finish()
        listening = True
        if self.stream and (delta or kept):
            listening = self._push(Event("tokens", text=delta, token_ids=kept))
        if reason is not None:
            self._end(reason)
        elif not listening:
            self.finished = True  # the caller's loop is gone: stop computing for it
        return self.finished

    def fail(self, error: ServeError) -> None:
        if self.finished:
            return
        self.finished = True
        self.t_end = time.perf_counter()
        self.error = error
        self._push(Event("error", error=error))

    def _end(self, reason: FinishReason) -> None:
        self.finished = True
        self.finish_reason = reason
        self.t_end = time.perf_counter()
        self.metrics.e2e.observe(self.t_end - self.t_arrival)
        n = len(self.token_ids)
        if n > 1 and self.t_first is not None:
            self.metrics.tpot.observe((self.t_end - self.t_first) / (n - 1))
        self._push(Event("done", finish_reason=reason))

    def _push(self, ev: Event) -> bool:
        """Hand ``ev`` to the caller; False if its event loop is closed."""
        if self._q is not None:
            self._q.put_nowait(ev)
            return True
        assert self._loop is not None and self._aq is not None
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False
        return True


__all__ = ["Event", "EventKind", "FinishReason", "RequestStream"]
