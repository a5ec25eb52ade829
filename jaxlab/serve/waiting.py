"""The requests the scheduler holds: the bounded waiting queue, cancellation and deadlines.

:class:`Waiting` is the thread-safe side of the scheduler: the HTTP side puts requests in
and cancels them from its own thread; the engine thread takes them out for admission,
drops the cancelled and timed-out ones, puts back at the head the ones it could not
admit or preempted, and sleeps on its condition when idle. Each request is an
:class:`Entry`, the scheduler's own record of it (slot, deadline, flags, the tokens it got
so far, and the :class:`Output` the scheduler reports to), never seen outside
:mod:`jaxlab.serve.scheduler`. Nothing here touches the device, chooses slots or reports to
a request's output.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from jaxlab.serve.errors import Cancelled, NotAccepting, QueueFull, RequestTimeout, ServeError

if TYPE_CHECKING:
    from jaxlab.infer.request import Request


class Output(Protocol):
    """Where the scheduler reports one request (on the engine thread: never block).

    ``admitted(cached_tokens)``: it left the queue, its prefill starts (once, even if it is
    preempted and admitted again later); ``cached_tokens`` of its prompt came from the
    prefix cache. ``emit(tokens, done)``: new tokens, a stop token included (``done``: the
    row ended on the device); True means the request is finished (e.g. a stop string
    matched) and its slot is freed at once. ``fail(error)``: it ended without finishing;
    its slot and pages, if any, are already free. ``speculated(drafted, accepted, on)``: a
    speculating engine drafted and accepted these many tokens for it in one chunk (reported
    before that chunk's tokens); ``on`` is False once it stopped speculating.
    """

    def admitted(self, cached_tokens: int) -> None: ...

    def speculated(self, drafted: int, accepted: int, on: bool) -> None: ...

    def emit(self, tokens: list[int], done: bool) -> bool: ...

    def fail(self, error: ServeError) -> None: ...


@dataclass(eq=False)
class Entry:
    """One request as the scheduler tracks it, from :meth:`Waiting.put` to its end.

    While it holds a slot it also holds pages in that slot group's pool (the pool knows it
    by ``id``), filled with ``seq``: its prompt and the tokens it had generated when it was
    admitted (a preempted request is recomputed), of which ``computed`` are prefilled.
    """

    id: int
    request: Request
    output: Output
    deadline: float
    slot: int | None = None
    generated: list[int] = field(default_factory=list)  # every token emitted so far
    seq: tuple[int, ...] = ()
    computed: int = 0
    decoding: bool = False  # its row is in the decode state (prefill done, inserted)
    order: int = 0  # admission number: the newest is preempted first
    cached_tokens: int | None = None  # prefix-cache hit of its first admission
    cancelled: bool = False
    finished: bool = False


class Waiting:
    """Requests waiting for a slot, at most ``max_queue``; each must end within
    ``timeout_s`` of :meth:`put`. Every method is thread-safe."""

    def __init__(self, max_queue: int, timeout_s: float) -> None:
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._cv = threading.Condition()
        self._queue: deque[Entry] = deque()
        self._live: dict[int, Entry] = {}  # queued or running, for cancel()
        self._ids = itertools.count(1)
        self.accepting = True
        self.paused = False
        self.stopped = False

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, request: Request, output: Output) -> Entry:
        """Queue a request; raises :class:`QueueFull` or :class:`NotAccepting`."""
        with self._cv:
            if not self.accepting:
                raise NotAccepting("stopped" if self.stopped else "draining")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(len(self._queue))
            entry = Entry(next(self._ids), request, output, time.perf_counter() + self.timeout_s)
            self._queue.append(entry)
            self._live[entry.id] = entry
            self._cv.notify_all()
        return entry

    def cancel(self, rid: int) -> None:
        """Flag request ``rid`` (queued or running) as cancelled; no-op once it ended."""
        with self._cv:
            entry = self._live.get(rid)
            if entry is not None:
                entry.cancelled = True
                self._cv.notify_all()

    def expired(self, entry: Entry, now: float) -> ServeError | None:
        """Why ``entry`` must end now (cancelled, past its deadline), or None."""
        if entry.cancelled:
            return Cancelled()
        if now >= entry.deadline:
            return RequestTimeout(self.timeout_s)
        return None

    def poll(self, free: int) -> tuple[list[tuple[Entry, ServeError]], list[Entry]]:
        """``(dropped, admit)``: the queued requests that must end (cancelled, timed out),
        taken out with their reason, and up to ``free`` to admit, in arrival order (none
        while paused)."""
        now = time.perf_counter()
        with self._cv:
            dropped: list[tuple[Entry, ServeError]] = []
            keep: deque[Entry] = deque()
            for entry in self._queue:
                why = self.expired(entry, now)
                if why is None:
                    keep.append(entry)
                else:
                    dropped.append((entry, why))
            self._queue = keep
            admit: list[Entry] = []
            while not self.paused and len(admit) < free and self._queue:
                admit.append(self._queue.popleft())
        return dropped, admit

    def put_back(self, entries: list[Entry]) -> None:
        """Return ``entries`` to the head of the queue, in this order: requests taken out
        that could not be admitted (no pages), and preempted ones. ``max_queue`` does not
        apply: they were accepted already."""
        with self._cv:
            self._queue.extendleft(reversed(entries))
            self._cv.notify_all()

    def end(self, entry: Entry) -> bool:
        """Mark ``entry`` finished (it cannot be cancelled any more); False if it was."""
        with self._cv:
            if entry.finished:
                return False
            entry.finished = True
            self._live.pop(entry.id, None)
        return True

    def drain_all(self) -> list[Entry]:
        """Take every queued request out (shutdown)."""
        with self._cv:
            out = list(self._queue)
            self._queue.clear()
        return out

    def set(
        self,
        *,
        accepting: bool | None = None,
        paused: bool | None = None,
        stopped: bool | None = None,
    ) -> None:
        """Change the given flags and wake the engine thread."""
        with self._cv:
            self.accepting = self.accepting if accepting is None else accepting
            self.paused = self.paused if paused is None else paused
            self.stopped = self.stopped if stopped is None else stopped
            self._cv.notify_all()

    def sleep(self, timeout_s: float, free: bool) -> None:
        """Wait for news (a request, a cancel, a flag) for at most ``timeout_s``, unless a
        queued request could be admitted already (``free``: a slot is free) or the
        scheduler is stopping."""
        with self._cv:
            if self.stopped or (free and self._queue and not self.paused):
                return
            self._cv.wait(timeout=timeout_s)


__all__ = ["Entry", "Output", "Waiting"]
