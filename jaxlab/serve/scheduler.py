"""Continuous batching: admission into decode slots, and the decode loop.

The scheduler takes checked :class:`~jaxlab.infer.request.Request` objects, each with an
:class:`Output`, queues them (:mod:`jaxlab.serve.waiting`) and runs them over the engine's
verbs on ``slots`` decode slots held in slot groups (:mod:`jaxlab.serve.slots`), as the
pure functions of :mod:`jaxlab.serve.policy` decide. It reports ``(tokens, done)`` and
failures to each request's output and knows nothing of HTTP, text or tokenizers: stop
strings, detokenisation and per-request metrics are the output's
(:mod:`jaxlab.serve.output`).

One :meth:`Scheduler.step` (:meth:`Scheduler.run` loops it on the engine thread)::

    drop cancelled / timed-out requests (their slots are freed at once)
    admit: while a slot is free and a request waits -> prefill -> insert
           (admitted requests go in groups of the compiled sizes, the last one padded;
           requests that arrive meanwhile are admitted too, before the next chunk)
    one generate(k) per slot group with a busy slot, all at once
    hand the *previous* chunk's tokens to their outputs; free the finished slots

Decoding is pipelined one chunk deep: the host routes chunk ``i`` while chunk ``i + 1``
runs, so the device never waits for the host's per-token work. Each chunk carries the
slot -> request map of its dispatch time; a request that finished meanwhile (its output
asked to stop, a cancel) ignores the tokens computed for it after that. With
``chunk_delay_s`` (tests: a slower device) a chunk is routed as soon as it is done.

Warm-up (:meth:`Scheduler.warmup`) compiles every shape the loop uses; after it nothing
compiles while serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxlab.serve.errors import Cancelled, EngineFailure, ServeError, ShuttingDown
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.policy import admission_sizes, pick_slots, split_admission
from jaxlab.serve.slots import Engine, SlotGroup, SlotGroups
from jaxlab.serve.waiting import Entry, Output, Waiting

if TYPE_CHECKING:
    from jaxlab.infer.request import Request

log = logging.getLogger("jaxlab.serve")

#: Token of the padding rows of an admission group (any valid id: the row takes no slot).
PAD_TOKEN = 0


@dataclass
class _Chunk:
    """A dispatched chunk: ``(group, tokens, done)`` per group that ran, on device, and the
    slot owners at dispatch."""

    ran: list[tuple[SlotGroup, Any, Any]]
    owners: list[Entry | None]


class Scheduler:
    """Slots, the waiting queue and the decode loop (module docstring).

    Args:
      engine: the engine's verbs (:class:`~jaxlab.serve.slots.Engine`: a real
        :class:`~jaxlab.infer.engine.Engine`, or a fake).
      slots: decode slots (rows of the KV cache), split into ``decode_groups`` equal slot
        groups (a divisor of ``slots``: :func:`~jaxlab.serve.policy.decode_groups_for`).
      max_queue: waiting requests beyond which :meth:`submit` raises :class:`QueueFull`.
      request_timeout_s: arrival to last token; past it the request fails.
      chunk_tokens: decode steps per ``generate`` call.
      prefill_batch: the largest admission group prefilled as one ragged batch; the
        smaller ones are :func:`~jaxlab.serve.policy.admission_sizes`.
      metrics: where the gauges (running, waiting, cache usage, slots) go.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        slots: int,
        max_queue: int,
        request_timeout_s: float,
        chunk_tokens: int,
        decode_groups: int = 1,
        prefill_batch: int = 1,
        metrics: ServeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.slots = slots
        self.prefill_batch = max(1, min(prefill_batch, slots))
        self.admission_sizes = admission_sizes(self.prefill_batch)
        self.chunk_tokens = chunk_tokens
        self.metrics = metrics or ServeMetrics()
        self.metrics.slots.set(slots)
        self.metrics.decode_groups.set(decode_groups)
        self.groups = SlotGroups(engine, slots, decode_groups)
        #: Seconds between decode chunks (0 = none): a slower device, for tests.
        self.chunk_delay_s = 0.0
        self.chunks = 0
        self.compiles_after_warmup: dict[str, int] | None = None
        self.warmup_s: float | None = None
        self._waiting = Waiting(max_queue, request_timeout_s)
        self._running: list[Entry | None] = [None] * slots
        self._abort: ServeError | None = None
        self._next_chunk_at = 0.0
        self._inflight: _Chunk | None = None

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0

    # ------------------------------------------------------------------ warm-up

    def warmup(self, should_stop: Callable[[], bool] | None = None) -> dict[str, int] | None:
        """Compile every shape the loop uses (:meth:`SlotGroups.warm_up` with this
        scheduler's admission sizes and chunk length); return the engine's compile counts.

        ``should_stop`` is asked before each compile; once it says yes the warm-up ends
        there and returns None (the scheduler is then not usable), so a stop during a long
        warm-up waits for one compile, not for all of them.
        """
        t0 = time.perf_counter()

        def quiet(record: logging.LogRecord) -> bool:
            # Warm-up compiles on purpose: "recompiled" warnings are for serving.
            return "recompiled" not in record.getMessage()

        logging.getLogger("jaxlab.compile").addFilter(quiet)
        try:
            calls = self.groups.warm_up(self.admission_sizes, self.chunk_tokens, PAD_TOKEN)
            for _ in calls:  # one compile per step
                if should_stop is not None and should_stop():
                    return None
        finally:
            logging.getLogger("jaxlab.compile").removeFilter(quiet)
            self.warmup_s = time.perf_counter() - t0
        self.compiles_after_warmup = dict(self.engine.compiles)
        return self.compiles_after_warmup

    # ------------------------------------------------------------------ the caller's side

    def submit(self, request: Request, output: Output) -> int:
        """Queue ``request`` (checked by ``Request.create``); its results go to ``output``.
        Returns its id (for :meth:`cancel`). Raises :class:`~jaxlab.serve.errors.QueueFull`
        or :class:`~jaxlab.serve.errors.NotAccepting`. Thread-safe."""
        entry = self._waiting.put(request, output)
        self.metrics.waiting.set(len(self._waiting))
        return entry.id

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` (no-op once it ended): it leaves the queue or its slot is
        freed on the next step, and its output fails with ``Cancelled``. Thread-safe."""
        self._waiting.cancel(rid)

    def close_admission(self) -> None:
        """Refuse new requests from now on (draining); queued and running ones finish."""
        self._waiting.set(accepting=False)

    def pause_admission(self) -> None:
        """Hold queued requests in the queue (running ones continue). For tests/ops."""
        self._waiting.set(paused=True)

    def resume_admission(self) -> None:
        self._waiting.set(paused=False)

    def stop(self, abort: ServeError | None = None) -> None:
        """End :meth:`run`; every request still queued or running fails with ``abort``."""
        self._abort = abort or ShuttingDown()
        self._waiting.set(accepting=False, stopped=True)

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Step until :meth:`stop` (the engine thread); warms up first if not done yet."""
        if self.compiles_after_warmup is None:
            self.warmup()
        try:
            while not self._waiting.stopped:
                if not self.step():
                    wait = 0.05  # also the period of the queue's timeout checks
                    if self.num_running:
                        wait = min(max(self._next_chunk_at - time.perf_counter(), 0.0), wait)
                    self._waiting.sleep(wait, free=None in self._running)
                self._update_gauges()
        finally:  # stopped, or the loop itself crashed: nothing in flight is left waiting
            self._shutdown()

    def step(self) -> bool:
        """One iteration (module docstring); False when there was nothing to do."""
        if self._waiting.stopped:
            return False
        dropped, admit = self._waiting.poll(free=self._running.count(None))
        for entry, why in dropped:
            self._fail(entry, why)
        now, reaped = time.perf_counter(), 0
        for entry in list(self._running):  # cancelled and timed-out running requests
            why = None if entry is None else self._waiting.expired(entry, now)
            if entry is not None and why is not None:
                self._fail(entry, why)
                reaped += 1
        admitted = self._admit_until_full(admit)
        if self.num_running and time.perf_counter() >= self._next_chunk_at:
            self._decode_chunk()
        elif self._inflight is not None:
            chunk, self._inflight = self._inflight, None
            self._route(chunk)
        else:
            return bool(dropped or reaped or admitted)
        return True

    def _admit_until_full(self, admit: list[Entry]) -> int:
        """Admit ``admit``, then whatever arrived during its prefills, until the queue is
        empty or no slot is free; returns how many requests were taken.

        Prefill goes before the next decode chunk (as vLLM's scheduler prefers prefills):
        a wave of freed slots refilled over a few milliseconds is admitted in one go, and
        its rows decode, and finish, together. At most ``slots`` requests per call:
        requests that finish in prefill take no slot, and a stream of them must not starve
        the requests that are decoding.
        """
        taken = 0
        while admit:
            taken += len(admit)
            # Similar lengths share a bucket: sort, then cut into the compiled group sizes.
            admit.sort(key=lambda entry: len(entry.request.prompt_ids))
            i = 0
            for size in split_admission(len(admit), self.admission_sizes):
                self._admit_group(admit[i : i + size], size)
                i += size
            if self._waiting.stopped:
                break
            free = min(self._running.count(None), self.slots - taken)
            dropped, admit = self._waiting.poll(free=free)
            for entry, why in dropped:
                self._fail(entry, why)
        return taken

    def _admit_group(self, group: list[Entry], rows: int) -> None:
        """Prefill ``group`` as one batch of ``rows`` rows (rows past it are padding, never
        inserted), then insert it: one insert per slot group its rows land in.

        One request never fails another. Each is prepared alone first (its sampling values
        in the device's dtypes, kept for the prefill), and when a batched prefill raises,
        its requests are prefilled again one by one (``(bucket, 1)`` is compiled too).
        """
        import jax

        from jaxlab.infer.sampling import SamplingParams

        ready = []
        for entry in group:
            entry.output.admitted()
            try:
                _ = entry.request.sampling.row
                ready.append(entry)
            except Exception as e:  # Request.create's checks keep a checked request out
                log.error("preparing request %d failed: %s", entry.id, e)
                self._fail(entry, EngineFailure(f"preparing the request failed: {e}"))
        parts = [(ready, rows)] if len(ready) > 1 else [([entry], 1) for entry in ready]
        while parts:
            part, n = parts.pop(0)
            prompts = [entry.request.prompt_ids for entry in part]
            samplings = [entry.request.sampling for entry in part]
            prompts += [(PAD_TOKEN,)] * (n - len(part))
            samplings += [SamplingParams(max_new_tokens=1)] * (n - len(part))
            try:
                pre = self.engine.prefill(prompts, samplings)
                first, done = jax.device_get((pre.tokens, pre.done))
            except Exception as e:
                if len(part) > 1:
                    ids = [entry.id for entry in part]
                    log.warning("prefill of requests %s failed (%r); prefilling each alone", ids, e)
                    parts = [([entry], 1) for entry in part]
                    continue
                log.exception("prefill failed for request %d", part[0].id)
                self._fail(part[0], EngineFailure(f"prefill failed: {e}"))
                continue
            self._insert(part, pre, first, done)

    def _insert(self, group: list[Entry], pre: Any, first: Any, done: Any) -> None:
        """Put the prefilled rows of ``group`` into free slots (a row done in prefill takes
        none) and report each request's first token."""
        pad = len(first) - len(group)
        busy = [entry is not None for entry in self._running]
        free = pick_slots(busy, self.groups.rows, sum(not done[i] for i in range(len(group))))
        slots = [-1 if done[i] else free.pop(0) for i in range(len(group))] + [-1] * pad
        try:
            self.groups.insert(pre.state, slots)
        except Exception as e:
            for entry in group:
                self._fail(entry, EngineFailure(f"insert failed: {e}"))
            self._device_failed("insert", e)
            return
        for i, entry in enumerate(group):
            if slots[i] >= 0:
                self._running[slots[i]] = entry
                entry.slot = slots[i]
            self._emit(entry, [int(first[i])], bool(done[i]))

    def _decode_chunk(self) -> None:
        """Dispatch the next chunk, then route the one before it (module docstring)."""
        owners = list(self._running)
        try:
            ran = self.groups.generate([entry is not None for entry in owners], self.chunk_tokens)
        except Exception as e:
            self._device_failed("decode", e)
            return
        self.chunks += 1
        self._next_chunk_at = time.perf_counter() + self.chunk_delay_s
        previous, self._inflight = self._inflight, _Chunk(ran, owners)
        if previous is not None:
            self._route(previous)

    def _route(self, chunk: _Chunk) -> None:
        """Hand each row's new tokens to the request that owned the slot at dispatch."""
        import jax

        try:
            host = jax.device_get([(tokens, done) for _, tokens, done in chunk.ran])
        except Exception as e:
            self._device_failed("decode", e)
            return
        for (g, _, _), (tokens, done) in zip(chunk.ran, host, strict=True):
            for row, slot in enumerate(g.slots):
                entry = chunk.owners[slot]
                if entry is not None and not entry.finished:
                    self._emit(entry, [int(t) for t in tokens[:, row] if t >= 0], bool(done[row]))

    # ------------------------------------------------------------------ ends of a request

    def _emit(self, entry: Entry, tokens: list[int], done: bool) -> None:
        """Report ``tokens`` to the request's output; end it if it is done or asks to."""
        if entry.finished:
            return
        if entry.cancelled:
            self._fail(entry, Cancelled(), on_device=not done)
            return
        entry.tokens += len(tokens)
        try:
            finished = entry.output.emit(tokens, done)
        except Exception as e:
            log.exception("output processing failed for request %d", entry.id)
            self._fail(entry, EngineFailure(f"output processing failed: {e}"), on_device=not done)
            return
        if done or finished:
            self._waiting.end(entry)
            self._free(entry, on_device=not done)  # a done row is already empty on the device

    def _fail(self, entry: Entry, error: ServeError, *, on_device: bool = True) -> None:
        self._free(entry, on_device=on_device)
        if self._waiting.end(entry):
            try:
                entry.output.fail(error)
            except Exception:
                log.exception("reporting the failure of request %d failed", entry.id)

    def _free(self, entry: Entry, *, on_device: bool) -> None:
        """Free ``entry``'s slot, if it holds one: on the host, and with ``on_device`` on the
        device too (:meth:`SlotGroups.free`, after the group's chunk in flight)."""
        slot = entry.slot
        if slot is None:
            return
        self._running[slot] = None
        entry.slot = None
        if on_device:
            try:
                self.groups.free(slot)
            except Exception as e:
                self._device_failed("freeing a slot", e)

    def _device_failed(self, what: str, e: Exception) -> None:
        """An insert or a chunk failed: the decode states it was given are gone (donated),
        so every running request fails, every group starts afresh and the chunk in flight
        is dropped."""
        log.error("%s failed; failing the running requests", what, exc_info=e)
        for entry in list(self._running):
            if entry is not None:
                self._fail(entry, EngineFailure(f"{what} failed: {e}"), on_device=False)
        self._inflight = None
        self.groups.reset()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.running.set(self.num_running)
        m.waiting.set(len(self._waiting))
        held = sum(len(s.request.prompt_ids) + s.tokens for s in self._running if s is not None)
        m.kv_usage.set(held / (self.slots * self.engine.max_len))

    def _shutdown(self) -> None:
        self._waiting.set(accepting=False, stopped=True)
        pending = [*self._waiting.drain_all(), *(s for s in self._running if s is not None)]
        self._inflight = None
        for entry in pending:
            self._fail(entry, self._abort or ShuttingDown(), on_device=False)
        self.groups.close()
        self._update_gauges()


__all__ = ["PAD_TOKEN", "Output", "Scheduler"]
