"""Continuous batching over the engine's building blocks, on one dedicated thread.

The scheduler owns ``slots`` decode slots, split into ``decode_groups`` equal **slot
groups**; each group is one batched :class:`~jaxlab.infer.state.DecodeState` (its own KV
cache rows) whose computations are dispatched from a thread of its own. It loops::

    drop cancelled / timed-out requests (their slots are freed at once)
    admit: while a slot is free and a request waits -> prefill (bucketed) -> insert
           (requests admitted together go in groups of ``prefill_batch``, the last one
           padded up to the smallest group size that holds it: one ragged prefill and
           one ``insert_rows`` per slot group it lands in;
           a request takes the lowest free slot of the least busy slot group; requests
           that arrive during these prefills are admitted too, before the next chunk:
           prefill goes first)
    one generate_chunk(k) per slot group with a busy slot, all at once, one thread
           each                                (one jitted while_loop, <= k tokens each;
                                                rows past a group's last busy slot skipped)
    route the *previous* chunk's tokens to their requests; free the finished slots

Why groups: XLA:CPU runs one small decode step on about one core, and executions that
two threads dispatch run side by side, so on a 2-core CPU two 8-row groups decode more
tokens/s than one 16-row batch (:func:`decode_groups_for`, ``docs/serving.md``). With
one group this is the plain continuous-batching loop, on the same code path.

Decoding is pipelined one chunk deep: the host routes chunk ``i`` while chunk ``i + 1``
runs, so the device never waits for the host's per-token work (text assembly, events,
HTTP). Each chunk carries the slot -> request map of its dispatch time; a request that
finished meanwhile (stop string, cancel) ignores the tokens computed for it after that.
A row inserted after a dispatch joins the next chunk. With ``chunk_delay_s`` (tests) a
chunk is routed as soon as it is done instead, as the loop is not dispatching.

Requests come from the asyncio side through :meth:`Scheduler.submit` (thread-safe); the
scheduler answers through per-request queues: an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe`` (or a ``queue.Queue`` for synchronous callers).

A slot is freed on the device by inserting an empty one-row state (``done``, budget 0)
over it, so a cancelled or stop-string-finished row stops computing at once and the
decode loop's early exit ("every row done") still works (the insert runs after the
group's chunk in flight). Warm-up compiles every prefill bucket, ``insert`` and ``decode``
(once for the group's rows); after it nothing compiles while serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from jaxlab.serve.metrics import ServeMetrics
from jaxlab.tokenizer.detok import Detokenizer as TextAssembler

if TYPE_CHECKING:
    from jaxlab.infer.engine import Engine
    from jaxlab.infer.sampling import SamplingParams

log = logging.getLogger("jaxlab.serve")

EventKind = Literal["tokens", "done", "error"]


class _DropRecompileWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "recompiled" not in record.getMessage()


def admission_sizes(prefill_batch: int) -> tuple[int, ...]:
    """Group sizes for prefilling admitted requests together, largest first: the powers
    of two below ``prefill_batch``, and ``prefill_batch`` itself (``8 -> (8, 4, 2, 1)``).

    Why not only ``prefill_batch`` and 1: in a closed loop, requests mostly arrive a few
    at a time (a wave of slots frees, clients answer at slightly different moments), and
    one prompt alone is the least efficient prefill (bench-small, 64 tokens, per row:
    8.9 ms alone, 5.8 in twos, 4.9 in fours, 4.5 in eights). Every size is one more
    compiled prefill per bucket, so the sizes are few and fixed.
    """
    sizes = {prefill_batch}
    n = 1
    while n < prefill_batch:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes, reverse=True))


def split_admission(n: int, sizes: Sequence[int]) -> list[int]:
    """Prefill calls for ``n`` requests over the compiled group ``sizes`` (largest first,
    which include 1): full groups of the largest size, then one group of the smallest size
    that holds the rest, padded: ``15, (8, 4, 2, 1) -> [8, 8]``, ``3 -> [4]``.

    Why pad instead of cutting the rest into its binary digits (``15 -> [8, 4, 2, 1]``):
    a prefill call's cost grows much slower than its rows (bench-small, 64-token prompts,
    on the Intel VM: 6.1, 8.9, 15.1 and 24.6 ms for 1, 2, 4 and 8 rows), and each call
    also costs the engine thread a host round trip. In a closed loop the requests of a
    wave mostly arrive while the first one is prefilled, so 15 waiting is the common case.
    """
    largest = sizes[0]
    full, rest = divmod(n, largest)
    out = [largest] * full
    if rest:
        out.append(min(s for s in sizes if s >= rest))
    return out


class ServeError(Exception):
    """A request-level failure with the HTTP status and code it maps to."""

    def __init__(
        self, status: int, message: str, *, code: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after_s = retry_after_s


class QueueFull(ServeError):
    def __init__(self, waiting: int) -> None:
        super().__init__(
            503,
            f"the request queue is full ({waiting} waiting = serve.max_queue); retry later",
            code="queue_full",
            retry_after_s=1.0,
        )


class NotAccepting(ServeError):
    def __init__(self, state: str) -> None:
        super().__init__(
            503,
            f"the server is not accepting requests (model state: {state})",
            code="not_ready" if state != "draining" else "draining",
            retry_after_s=5.0,
        )


def _timeout_error(timeout_s: float) -> ServeError:
    return ServeError(
        504, f"request exceeded serve.request_timeout_s = {timeout_s:g}s", code="timeout"
    )


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decode_groups_for(slots: int, requested: int, platform: str, cores: int | None = None) -> int:
    """How many slot groups to decode concurrently (``serve.decode_groups``).

    ``requested > 0`` is taken as it is (it must divide ``slots``). ``0`` (auto) on the
    CPU backend is the most groups, at most ``cores`` (default :func:`usable_cores`), that
    split the slots evenly: 16 slots on 2 cores -> 2 groups of 8. Why: XLA:CPU runs one
    small decode step on about one core (a batch of 16 used 1.5 cores of 2), and two
    executions dispatched from two threads run side by side; measured on bench-small, two
    8-row groups decoded 1.4x the tokens/s of one 16-row batch (serving.md). Elsewhere
    (GPU, TPU) one device runs one program at a time, so auto is 1.
    """
    if requested:
        if slots % requested:
            raise ValueError(f"decode_groups={requested} must divide slots={slots}")
        return requested
    if platform != "cpu":
        return 1
    cap = max(1, min(slots, usable_cores() if cores is None else cores))
    return max(g for g in range(1, cap + 1) if slots % g == 0)


def pick_slots(busy: Sequence[bool], group_rows: int, n: int) -> list[int]:
    """``n`` free slots (``busy[s]`` false) for new requests, in the order they are taken.

    Slots ``g * group_rows ..`` form group ``g``. Each request takes the lowest free slot
    of the group with the fewest busy slots (ties: the lowest group), counting the ones
    taken before it: requests spread over the groups, so the groups' chunks share the work,
    and pack low within a group, as a decode step computes a group's rows only up to its
    last busy one. With one group: the ``n`` lowest free slots. Raises ``ValueError`` if
    fewer than ``n`` are free.
    """
    taken = list(busy)
    groups = [range(g, min(g + group_rows, len(busy))) for g in range(0, len(busy), group_rows)]
    load = [sum(taken[s] for s in r) for r in groups]
    out: list[int] = []
    for _ in range(n):
        open_groups = [i for i, r in enumerate(groups) if not all(taken[s] for s in r)]
        if not open_groups:
            raise ValueError(f"{n} slots asked, {busy.count(False)} free")
        i = min(open_groups, key=lambda i: (load[i], i))
        slot = next(s for s in groups[i] if not taken[s])
        taken[slot] = True
        load[i] += 1
        out.append(slot)
    return out


class _SlotGroup:
    """Slots ``start .. start + rows - 1``: one batched decode state of ``rows`` rows, and
    the one thread that dispatches every computation on it.

    XLA:CPU runs the computations one thread dispatches in dispatch order, and those of
    different threads side by side (measured: two 8-row chunks dispatched alternately from
    one thread took as long as both in a row; from two threads, 1.7x less). So each
    group's inserts and chunks go through its own thread: in order within the group,
    concurrent across groups. A call waits only for the (asynchronous) dispatch, about a
    millisecond, not for the computation.
    """

    def __init__(self, index: int, rows: int) -> None:
        self.start = index * rows
        self.rows = rows
        self.state: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"jaxlab-decode-{index}")

    @property
    def slots(self) -> range:
        return range(self.start, self.start + self.rows)

    def __contains__(self, slot: int) -> bool:
        return self.start <= slot < self.start + self.rows

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` dispatched from this group's thread."""
        return self._thread.submit(fn, *args).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@dataclass
class GenRequest:
    """One request as the scheduler sees it: token ids, sampling and stop strings."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()


@dataclass
class Event:
    kind: EventKind
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: ServeError | None = None


class RequestHandle:
    """The caller's side of one request: its events, its output so far, its timings.

    Timestamps are ``time.perf_counter()`` values; the derived durations are seconds.
    """

    def __init__(
        self,
        rid: int,
        request: GenRequest,
        *,
        loop: asyncio.AbstractEventLoop | None,
        stream: bool,
        deadline: float,
        stops: frozenset[int],
        assembler: TextAssembler,
        scheduler: Scheduler,
    ) -> None:
        self.id = rid
        self.request = request
        self.stream = stream
        self.deadline = deadline
        self.stop_ids = stops
        self.text = assembler
        self._scheduler = scheduler
        self._loop = loop
        self._aq: asyncio.Queue[Event] | None = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue[Event] | None = None if loop is not None else queue.Queue()
        self.cancelled = False
        self.finished = False
        self.finish_reason: str | None = None
        self.error: ServeError | None = None
        self.token_ids: list[int] = []
        self.slot: int | None = None
        self.t_arrival = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.prefill_s = 0.0

    # ------------------------------------------------------------------ caller side

    async def next(self) -> Event:
        assert self._aq is not None, "submitted without an event loop: use get()"
        return await self._aq.get()

    def get(self, timeout: float | None = None) -> Event:
        """Blocking variant of :meth:`next` for synchronous callers."""
        assert self._q is not None, "submitted with an event loop: use next()"
        return self._q.get(timeout=timeout)

    def cancel(self) -> None:
        """Stop this request (no-op once finished); its slot is freed by the scheduler."""
        if not self.finished:
            self.cancelled = True
            self._scheduler._wake()

    @property
    def output_text(self) -> str:
        return self.text.text

    @property
    def queue_s(self) -> float:
        return (self.t_admit or self.t_arrival) - self.t_arrival

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

    # ------------------------------------------------------------------ scheduler side

    def _push(self, ev: Event) -> None:
        if self._q is not None:
            self._q.put_nowait(ev)
            return
        assert self._loop is not None and self._aq is not None
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True


class Scheduler:
    """Slots, the waiting queue and the decode loop (:meth:`run` is the engine thread).

    Args:
      engine: a loaded :class:`~jaxlab.infer.engine.Engine`.
      slots: decode slots (rows of the batched KV cache).
      prefill_batch: the largest group of requests admitted at once that is prefilled
        as one ragged batch. Groups have the sizes :func:`admission_sizes` gives
        (powers of two below it, and itself), so prefill compiles once per (bucket,
        size): ``buckets * len(sizes)`` shapes, all compiled by :meth:`warmup`.
      max_queue: waiting requests beyond which :meth:`submit` raises :class:`QueueFull`.
      request_timeout_s: arrival to last token; past it the request fails with 504.
      chunk_tokens: decode steps per ``generate_chunk`` call (default
        ``inference.stream_chunk_tokens``).
      decode_groups: the slots split into this many equal groups, each its own batched
        state whose chunks run on a thread of their own, all groups' chunks at once
        (:func:`decode_groups_for`). Must divide ``slots``. The decode step compiles once
        for the group's rows, whatever the number of groups.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        slots: int,
        max_queue: int,
        prefill_batch: int = 1,
        request_timeout_s: float,
        chunk_tokens: int | None = None,
        decode_groups: int = 1,
        metrics: ServeMetrics | None = None,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError("serving needs an engine with a tokenizer")
        if decode_groups < 1 or slots % decode_groups:
            raise ValueError(f"decode_groups={decode_groups} must divide slots={slots}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.slots = slots
        self.prefill_batch = max(1, min(prefill_batch, slots))
        self.admission_sizes = admission_sizes(self.prefill_batch)
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.chunk_tokens = chunk_tokens or engine.cfg.inference.stream_chunk_tokens
        self.metrics = metrics or ServeMetrics()
        self.metrics.slots.set(slots)
        self.metrics.decode_groups.set(decode_groups)
        #: Seconds to wait between decode chunks (0 = none): simulates a slower device,
        #: e.g. to test draining and timeouts deterministically.
        self.chunk_delay_s = 0.0
        self.chunks = 0
        self._cv = threading.Condition()
        self._waiting: deque[RequestHandle] = deque()
        self._running: list[RequestHandle | None] = [None] * slots
        self._ids = itertools.count(1)
        self._accepting = True
        self._admission_paused = False
        self._stop = False
        self._abort: ServeError | None = None
        rows = slots // decode_groups
        self.groups = [_SlotGroup(g, rows) for g in range(decode_groups)]
        self._empty: Any = None
        self._next_chunk_at = 0.0
        #: The dispatched, not yet routed chunk: per group that ran it ``(group, tokens,
        #: done)`` (device arrays), and the slot owners at dispatch.
        self._inflight: tuple[list[tuple[_SlotGroup, Any, Any]], list[Any]] | None = None
        self.compiles_after_warmup: dict[str, int] | None = None
        self.warmup_s: float | None = None

    # ------------------------------------------------------------------ facts

    @property
    def num_running(self) -> int:
        return sum(h is not None for h in self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------ warm-up

    def warmup(self, should_stop: Callable[[], bool] | None = None) -> dict[str, int] | None:
        """Compile every prefill bucket, ``insert`` and ``decode``; return the counts.

        ``should_stop`` is asked before each compile; once it says yes the warm-up ends
        there and returns ``None`` (the scheduler is then not usable). A SIGTERM during a
        warm-up of tens of seconds so waits for one compile, not for all of them.
        """
        t0 = time.perf_counter()
        eng = self.engine
        # Warm-up compiles every bucket on purpose: keep the "recompiled" warnings for
        # compiles that happen while serving.
        quiet = _DropRecompileWarnings()
        logging.getLogger("jaxlab.compile").addFilter(quiet)
        try:
            for _ in self._warmup_calls():  # one compile per step
                if should_stop is not None and should_stop():
                    return None
        finally:
            logging.getLogger("jaxlab.compile").removeFilter(quiet)
            self.warmup_s = time.perf_counter() - t0
        self.compiles_after_warmup = dict(eng.compiles)
        return self.compiles_after_warmup

    def _warmup_calls(self) -> Iterator[None]:
        """The warm-up, one compile per step: it yields before each one."""
        import jax

        from jaxlab.infer.sampling import SamplingParams

        eng = self.engine
        yield
        for group in self.groups:  # every group has the same shapes: one compile each
            group.state = group.call(eng.init_decode_state, group.rows)
        self._empty = eng.init_decode_state(1)
        first = self.groups[0]
        tok = self.tokenizer.eot_id
        one = SamplingParams(max_new_tokens=1)
        sizes = [g for g in self.admission_sizes if g > 1]
        for b in eng.buckets:
            n = min(b, eng.max_len - 1)
            yield
            jax.block_until_ready(eng.prefill([tok] * n, one))
            for g in sizes:
                yield
                jax.block_until_ready(eng.prefill_batch([[tok] * n] * g, [one] * g, bucket=b))
        for g in sizes:  # compile insert_rows: write nothing (every row skipped)
            yield
            rows, _ = eng.prefill_batch([[tok]] * g, [one] * g)
            first.state = first.call(eng.insert_rows, rows, first.state, [-1] * g)
        yield
        # One real pass through insert -> decode -> free, on slot 0.
        budget = 2 if eng.max_len >= 3 else 1
        prefix = eng.prefill([tok], SamplingParams(max_new_tokens=budget, ignore_eos=True))
        first.state = first.call(eng.insert, prefix, first.state, 0)
        first.state, out, _ = first.call(eng.generate_chunk, first.state, self.chunk_tokens)
        first.state = first.call(eng.insert, self._empty, first.state, 0)
        jax.block_until_ready((out, first.state))

    # ------------------------------------------------------------------ caller API

    def submit(
        self,
        request: GenRequest,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = False,
    ) -> RequestHandle:
        """Queue ``request``; raises ``BadRequest``/``RequestTooLong``, :class:`QueueFull`
        or :class:`NotAccepting`. Thread-safe."""
        self.engine.check_request(request.prompt_ids, request.sampling)
        sp = request.sampling
        stops = frozenset(sp.stop_token_ids) | (
            frozenset() if sp.ignore_eos or self.engine.eos_id is None else {self.engine.eos_id}
        )
        with self._cv:
            if not self._accepting or self._stop:
                raise NotAccepting("draining")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(len(self._waiting))
            h = RequestHandle(
                next(self._ids),
                request,
                loop=loop,
                stream=stream,
                deadline=time.perf_counter() + self.request_timeout_s,
                stops=stops,
                assembler=TextAssembler(self.tokenizer, request.stop),
                scheduler=self,
            )
            self._waiting.append(h)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify_all()
        return h

    def close_admission(self) -> None:
        """Refuse new requests from now on (draining); queued and running ones finish."""
        with self._cv:
            self._accepting = False
            self._cv.notify_all()

    def pause_admission(self) -> None:
        """Hold queued requests in the queue (running ones continue). For tests/ops."""
        with self._cv:
            self._admission_paused = True

    def resume_admission(self) -> None:
        with self._cv:
            self._admission_paused = False
            self._cv.notify_all()

    def stop(self, abort: ServeError | None = None) -> None:
        """End :meth:`run`; every request still queued or running fails with ``abort``."""
        with self._cv:
            self._stop = True
            self._accepting = False
            self._abort = abort or ServeError(
                503, "the server is shutting down", code="shutting_down"
            )
            self._cv.notify_all()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """The scheduler loop; returns after :meth:`stop`. Call :meth:`warmup` first."""
        if self._empty is None:
            self.warmup()
        while True:
            with self._cv:
                if self._stop:
                    break
                dropped = self._reap_waiting()
                admit = self._take_admissible(limit=self.slots)
            for h, err in dropped:
                self._finish(h, error=err)
            self._reap_running()
            admitted = self._admit_until_full(admit)
            if self.num_running and time.perf_counter() >= self._next_chunk_at:
                self._decode_chunk()
            elif self._inflight is not None:
                self._route_inflight()
            elif not admitted and not dropped:
                self._update_gauges()
                with self._cv:
                    can_admit = (
                        self._waiting and not self._admission_paused and None in self._running
                    )
                    if not self._stop and not can_admit:
                        wait = 0.05
                        if self.num_running:
                            wait = min(max(self._next_chunk_at - time.perf_counter(), 0.0), wait)
                        self._cv.wait(timeout=wait)
            self._update_gauges()
        self._shutdown()

    def _reap_waiting(self) -> list[tuple[RequestHandle, ServeError | None]]:
        """Take cancelled and timed-out requests out of the queue (caller holds the lock)."""
        now = time.perf_counter()
        keep: deque[RequestHandle] = deque()
        dropped: list[tuple[RequestHandle, ServeError | None]] = []
        for h in self._waiting:
            if h.cancelled:
                dropped.append((h, None))
            elif now >= h.deadline:
                dropped.append((h, _timeout_error(self.request_timeout_s)))
            else:
                keep.append(h)
        self._waiting = keep
        return dropped

    def _reap_running(self) -> None:
        """Free the slots of cancelled and timed-out running requests."""
        now = time.perf_counter()
        for h in list(self._running):
            if h is None:
                continue
            if h.cancelled:
                self._release(h)
                self._finish(h, error=None)
            elif now >= h.deadline:
                self._release(h)
                self._finish(h, error=_timeout_error(self.request_timeout_s))

    def _release(self, h: RequestHandle) -> None:
        """Free ``h``'s slot: on the host, and on the device (an empty row inserted over it
        in its group, after the group's chunk in flight)."""
        slot = h.slot
        if slot is None:
            return
        self._running[slot] = None
        h.slot = None
        g = self.groups[slot // self.groups[0].rows]
        try:
            g.state = g.call(self.engine.insert, self._empty, g.state, slot - g.start)
        except Exception:  # the state is unusable: start from a fresh one
            log.exception("freeing slot %d failed; resetting the decode state", slot)
            self._reset_state()

    def _take_admissible(self, limit: int) -> list[RequestHandle]:
        """Pop as many waiting requests as there are free slots, at most ``limit`` (caller
        holds the lock)."""
        admit: list[RequestHandle] = []
        if not self._admission_paused:
            n = min(self._running.count(None), limit)
            while n > len(admit) and self._waiting:
                admit.append(self._waiting.popleft())
        return admit

    def _admit_until_full(self, admit: list[RequestHandle]) -> int:
        """Admit ``admit``, then whatever arrived during its prefills, until the queue is
        empty or no slot is free; returns how many requests were taken.

        Prefill goes before the next decode chunk (as vLLM's scheduler prefers prefills):
        a request that arrives while others are being prefilled joins them now instead of
        one chunk later. In a closed loop a wave of finished slots is refilled over a few
        milliseconds; admitted in one go, the wave's rows decode, and finish, together.
        Admitted one chunk apart, the late rows are still decoding when the rest finish,
        and the tail chunk computes every row for them. At most ``slots`` requests per
        call: requests that finish in prefill take no slot, and a stream of them must not
        starve the requests that are decoding.
        """
        taken = 0
        while admit:
            taken += len(admit)
            self._admit_all(admit)
            with self._cv:
                if self._stop:
                    break
                dropped = self._reap_waiting()
                admit = self._take_admissible(limit=self.slots - taken)
            for h, err in dropped:
                self._finish(h, error=err)
        return taken

    def _admit_all(self, admit: list[RequestHandle]) -> None:
        """Prefill and insert ``admit`` (at most the free slots' number of requests)."""
        # Similar lengths share a bucket: sort, then cut into the largest groups that fit.
        admit = sorted(admit, key=lambda h: len(h.request.prompt_ids))
        i = 0
        for size in split_admission(len(admit), self.admission_sizes):
            self._admit_group(admit[i : i + size], size)
            i += size

    def _admit_group(self, group: list[RequestHandle], rows: int) -> None:
        """One prefill of ``rows`` rows for ``group`` (ragged batch when several; rows past
        the group are padding: a one-token prompt, never inserted), then insert the rows."""
        import jax

        from jaxlab.infer.sampling import SamplingParams

        t_admit = time.perf_counter()
        for h in group:
            h.t_admit = t_admit
            self.metrics.queue_time.observe(t_admit - h.t_arrival)
            self.metrics.prompt_tokens.inc(len(h.request.prompt_ids))
        pad = rows - len(group)
        prompts = [h.request.prompt_ids for h in group] + [[self.tokenizer.eot_id]] * pad
        samplings = [h.request.sampling for h in group] + [SamplingParams(max_new_tokens=1)] * pad
        try:
            prefix, _ = self.engine.prefill_batch(prompts, samplings)
            first, done = jax.device_get((prefix.tokens, prefix.done))
        except Exception as e:
            log.exception("prefill failed for request(s) %s", [h.id for h in group])
            err = ServeError(500, f"prefill failed: {e}", code="internal_error")
            for h in group:
                self._finish(h, error=err)
            return
        prefill_s = time.perf_counter() - t_admit
        busy = [r is not None for r in self._running]
        free = pick_slots(busy, self.groups[0].rows, sum(not done[i] for i in range(len(group))))
        slots = [-1 if done[i] else free.pop(0) for i in range(len(group))] + [-1] * pad
        if any(s >= 0 for s in slots):
            try:
                for g in self.groups:
                    local = [s - g.start if s in g else -1 for s in slots]
                    if all(s < 0 for s in local):
                        continue
                    if rows == 1:
                        g.state = g.call(self.engine.insert, prefix, g.state, local[0])
                    else:
                        g.state = g.call(self.engine.insert_rows, prefix, g.state, local)
            except Exception as e:
                log.exception("insert failed for request(s) %s", [h.id for h in group])
                self._reset_state()
                err = ServeError(500, f"insert failed: {e}", code="internal_error")
                for h in group:
                    self._finish(h, error=err)
                return
        for i, h in enumerate(group):
            h.prefill_s = prefill_s
            if slots[i] >= 0:
                self._running[slots[i]] = h
                h.slot = slots[i]
            self._route(h, [int(first[i])], bool(done[i]))

    def _decode_chunk(self) -> None:
        """Dispatch the next chunk (one per group with a busy slot, each from its group's
        thread), then route the one before it (see the module docstring)."""
        owners = list(self._running)
        ran: list[tuple[_SlotGroup, Any, Any]] = []
        try:
            for g in self.groups:
                if any(owners[s] is not None for s in g.slots):
                    g.state, toks, done = g.call(
                        self.engine.generate_chunk, g.state, self.chunk_tokens
                    )
                    ran.append((g, toks, done))
        except Exception as e:
            self._decode_failed(e)
            return
        self.chunks += 1
        self._next_chunk_at = time.perf_counter() + self.chunk_delay_s
        previous, self._inflight = self._inflight, (ran, owners)
        if previous is not None:
            self._route_chunk(previous)

    def _route_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            self._route_chunk(inflight)

    def _route_chunk(self, chunk: tuple[list[tuple[_SlotGroup, Any, Any]], list[Any]]) -> None:
        import jax

        ran, owners = chunk
        try:
            host = jax.device_get([(toks, done) for _, toks, done in ran])
        except Exception as e:
            self._decode_failed(e)
            return
        for (g, _, _), (toks, done) in zip(ran, host, strict=True):
            for row, slot in enumerate(g.slots):
                h = owners[slot]
                if h is None or h.finished or h.slot != slot:
                    continue
                new = [int(t) for t in toks[:, row] if t >= 0]
                self._route(h, new, bool(done[row]))

    def _decode_failed(self, e: Exception) -> None:
        log.error("decode failed; failing the running requests", exc_info=e)
        err = ServeError(500, f"decode failed: {e}", code="internal_error")
        for h in list(self._running):
            if h is not None:
                self._finish(h, error=err)
        self._running = [None] * self.slots
        self._reset_state()  # drops the in-flight chunk too

    def _route(self, h: RequestHandle, tokens: Sequence[int], device_done: bool) -> None:
        """Hand ``tokens`` (this round's, for ``h``) to the request; finish it if done."""
        if h.cancelled:
            return  # reaped on the next iteration
        now = time.perf_counter()
        if h.t_first is None:
            h.t_first = now
            self.metrics.ttft.observe(now - h.t_arrival)
        by_token = False
        fresh = list(tokens)
        if device_done and fresh and fresh[-1] in h.stop_ids:
            fresh.pop()
            by_token = True
        kept: list[int] = []
        delta = ""
        for t in fresh:
            kept.append(t)
            delta += h.text.feed(t)
            if h.text.stopped:
                break
        h.token_ids.extend(kept)
        self.metrics.generation_tokens.inc(len(kept))
        reason: str | None = None
        if h.text.stopped:
            reason = "stop"
        elif device_done:
            reason = "stop" if by_token else "length"
        if reason is not None:
            delta += h.text.finish()
        if h.stream and (delta or kept):
            h._push(Event("tokens", text=delta, token_ids=kept))
        if reason is not None:
            if h.slot is not None:
                if device_done:  # the device row is already done: only the host frees it
                    self._running[h.slot] = None
                    h.slot = None
                else:
                    self._release(h)
            self._finish(h, reason=reason)

    def _finish(
        self, h: RequestHandle, *, reason: str | None = None, error: ServeError | None = None
    ) -> None:
        if h.finished:
            return
        h.finished = True
        h.t_end = time.perf_counter()
        if reason is not None:
            h.finish_reason = reason
            self.metrics.e2e.observe(h.t_end - h.t_arrival)
            n = len(h.token_ids)
            if n > 1 and h.t_first is not None:
                self.metrics.tpot.observe((h.t_end - h.t_first) / (n - 1))
            h._push(Event("done", finish_reason=reason))
        elif error is not None:
            h.error = error
            h._push(Event("error", error=error))
        else:  # cancelled by the caller: it is not listening, but unblock it anyway
            h._push(Event("error", error=ServeError(499, "cancelled", code="cancelled")))

    def _reset_state(self) -> None:
        self._inflight = None
        for g in self.groups:
            g.state = g.call(self.engine.init_decode_state, g.rows)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.num_running)
        m.waiting.set(len(self._waiting))
        held = sum(
            len(h.request.prompt_ids) + len(h.token_ids) for h in self._running if h is not None
        )
        m.kv_usage.set(held / (self.slots * self.engine.max_len))

    def _shutdown(self) -> None:
        err = self._abort or ServeError(503, "the server is shutting down", code="shutting_down")
        with self._cv:
            pending = [*self._waiting, *(h for h in self._running if h is not None)]
            self._waiting.clear()
        self._running = [None] * self.slots
        self._inflight = None
        for g in self.groups:
            g.close()
        for h in pending:
            self._finish(h, error=err)
        self._update_gauges()


__all__ = [
    "Event",
    "GenRequest",
    "NotAccepting",
    "QueueFull",
    "RequestHandle",
    "Scheduler",
    "ServeError",
]
