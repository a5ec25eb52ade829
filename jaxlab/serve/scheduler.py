"""Continuous batching over a paged KV cache: admission by memory, chunked prefill,
preemption, and the decode loop.

The scheduler takes checked :class:`~jaxlab.infer.request.Request` objects, each with an
:class:`Output`, queues them (:mod:`jaxlab.serve.waiting`) and runs them over the engine's
verbs on ``slots`` decode slots held in slot groups (:mod:`jaxlab.serve.slots`), each
group a decode state over a page pool of its own, as the pure functions of
:mod:`jaxlab.serve.policy` decide. It reports ``(tokens, done)`` and failures to each
request's output and knows nothing of HTTP, text or tokenizers: stop strings,
detokenisation and per-request metrics are the output's (:mod:`jaxlab.serve.output`).
The pools own the pages, the engine the device; the scheduler decides who gets which.

One :meth:`Scheduler.step` (:meth:`Scheduler.run` loops it on the engine thread)::

    drop cancelled / timed-out requests (their slots and pages are freed at once)
    prefill, until the step's token budget (serve.prefill_chunk_tokens) is spent:
        admit: while a slot is free and the head request's pages fit a group's pool
        prefill the next chunk of each admitted prompt, oldest first, one call per group
        insert the prompts whose last chunk ran (a row done already takes no slot)
    grow every decoding row's pages to cover the coming chunk; when a pool runs dry,
        preempt its newest request (pages and slot freed, requeued at the head)
    one generate(k) per slot group with a decoding row, all at once
    hand the *previous* chunk's tokens to their outputs; free the finished slots

Decoding is pipelined one chunk deep: the host routes chunk ``i`` while chunk ``i + 1``
runs, so the device never waits for the host's per-token work. Each chunk carries the
slot -> request map of its dispatch time; a request that finished meanwhile (its output
asked to stop, a cancel) ignores the tokens computed for it after that. With
``chunk_delay_s`` (tests: a slower device) a chunk is routed as soon as it is done. A
preemption first routes the chunk in flight, so the preempted request's tokens are all
known when it is requeued: it is recomputed from its prompt and those tokens, and its
output continues with the very next token.

Warm-up (:meth:`Scheduler.warmup`) compiles every shape the loop uses; after it nothing
compiles while serving.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxlab.serve.errors import Cancelled, EngineFailure, ServeError, ShuttingDown
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.policy import (
    admission_sizes,
    grow_target,
    kv_tokens,
    never_fits,
    pages_per_group,
    plan_chunks,
    slot_candidates,
    warm_chunk_lengths,
)
from jaxlab.serve.slots import PAD_TOKEN, Engine, SlotGroup, SlotGroups
from jaxlab.serve.waiting import Entry, Output, Waiting

if TYPE_CHECKING:
    from jaxlab.infer.chunks import Chunk
    from jaxlab.infer.request import Request

log = logging.getLogger("jaxlab.serve")


@dataclass
class _Chunk:
    """A dispatched chunk: ``(group, tokens, done, stats)`` per group that ran, on device
    (``stats``: a speculating engine's per-row counts, or None), and the slot owners at
    dispatch."""

    ran: list[tuple[SlotGroup, Any, Any, Any]]
    owners: list[Entry | None]


def adapter_salt(adapter: int) -> bytes:
    """The prefix cache's salt for a request of LoRA adapter ``adapter``: none for the base
    model, the id otherwise (a prompt's K/V differ between adapters)."""
    return b"" if adapter == 0 else f"adapter:{adapter}".encode()


class Scheduler:
    """Slots, pages, the waiting queue and the decode loop (module docstring).

    Args:
      engine: the engine's verbs (:class:`~jaxlab.serve.slots.Engine`: a real paged
        :class:`~jaxlab.infer.engine.Engine`, or a fake).
      slots: decode slots (rows of the decode states), split into ``decode_groups`` equal
        slot groups (a divisor of ``slots``: :func:`~jaxlab.serve.policy.decode_groups_for`).
      max_queue: waiting requests beyond which :meth:`submit` raises :class:`QueueFull`.
      request_timeout_s: arrival to last token; past it the request fails.
      chunk_tokens: decode steps per ``generate`` call.
      prefill_batch: the most chunks one group prefills in one call (the engine pads a
        call's rows to a power of two; the warm-up makes one call of each
        :func:`~jaxlab.serve.policy.admission_sizes` row count).
      num_pages: KV pages of the whole server, split evenly over the groups (default:
        every slot can hold ``max_len`` tokens, the memory of a contiguous cache).
      prefill_chunk_tokens: prompt tokens prefilled per step at most (0: whole prompts).
      prefix_caching: reuse the pages of prompt prefixes already computed.
      metrics: where the gauges and counters (running, waiting, pages, prefix cache,
        preemptions) go.
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
        num_pages: int | None = None,
        prefill_chunk_tokens: int = 0,
        prefix_caching: bool = False,
        metrics: ServeMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.slots = slots
        self.prefill_batch = max(1, min(prefill_batch, slots))
        self.admission_sizes = admission_sizes(self.prefill_batch)
        self.chunk_tokens = chunk_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_caching = prefix_caching
        self.page_size = engine.page_size
        max_pages = -(-engine.max_len // self.page_size)
        self.num_pages = slots * max_pages if num_pages is None else num_pages
        self.group_pages = pages_per_group(self.num_pages, decode_groups)
        self.metrics = metrics or ServeMetrics()
        self.metrics.slots.set(slots)
        self.metrics.decode_groups.set(decode_groups)
        self.groups = SlotGroups(engine, slots, decode_groups, self.group_pages, prefix_caching)
        self.metrics.pages_total.set(self.groups.pages_total)
        #: Seconds between decode chunks (0 = none): a slower device, for tests.
        self.chunk_delay_s = 0.0
        self.chunks = 0
        self.preemptions = 0
        self.compiles_after_warmup: dict[str, int] | None = None
        self.warmup_s: float | None = None
        self._waiting = Waiting(max_queue, request_timeout_s)
        self._running: list[Entry | None] = [None] * slots
        self._admissions = itertools.count(1)
        self._blocked = False  # the head request waits for pages, not for a slot
        self._abort: ServeError | None = None
        self._next_chunk_at = 0.0
        self._inflight: _Chunk | None = None

    @property
    def num_running(self) -> int:
        """Requests holding a slot (and pages): being prefilled or decoding."""
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
        scheduler's prefill row counts, chunk lengths and decode chunk); return the engine's
        compile counts.

        ``should_stop`` is asked before each compile; once it says yes the warm-up ends
        there and returns None (the scheduler is then not usable), so a stop during a long
        warm-up waits for one compile, not for all of them.
        """
        t0 = time.perf_counter()

        def quiet(record: logging.LogRecord) -> bool:
            # Warm-up compiles on purpose: "recompiled" warnings are for serving.
            return "recompiled" not in record.getMessage()

        eng = self.engine
        lengths = warm_chunk_lengths(eng.buckets, self.prefill_chunk_tokens, eng.max_len)
        # A chunk starts past 0 when a prompt is split, or when its prefix was cached.
        extend = self.prefill_chunk_tokens > 0 or self.prefix_caching
        logging.getLogger("jaxlab.compile").addFilter(quiet)
        try:
            calls = self.groups.warm_up(self.admission_sizes, lengths, extend, self.chunk_tokens)
            for _ in calls:  # one compile per step
                if should_stop is not None and should_stop():
                    return None
        finally:
            logging.getLogger("jaxlab.compile").removeFilter(quiet)
            self.warmup_s = time.perf_counter() - t0
        self.compiles_after_warmup = dict(self.engine.compiles)
        return self.compiles_after_warmup

    # ------------------------------------------------------------------ the caller's side

    def refusal(self, request: Request) -> str | None:
        """Why ``request`` can never run here (it needs more pages than a slot group's
        pool holds, even alone), or None. Checked before it is queued."""
        n, m = len(request.prompt_ids), request.sampling.max_new_tokens
        if not never_fits(n, m, self.page_size, self.group_pages):
            return None
        need = -(-(n + m) // self.page_size)
        split = f"{self.num_pages} pages over {len(self.groups)} slot groups"
        return (
            f"prompt ({n} tokens) + max_new_tokens ({m}) = {n + m} tokens needs {need} KV-cache"
            f" pages of {self.page_size} tokens, more than a slot group's pool holds"
            f" ({self.group_pages}: {split}, from inference.num_pages or"
            " inference.kv_cache_mib); shorten the prompt, lower max_tokens or raise the pool"
        )

    def submit(self, request: Request, output: Output) -> int:
        """Queue ``request`` (checked by ``Request.create``); its results go to ``output``.
        Returns its id (for :meth:`cancel`). Raises
        :class:`~jaxlab.infer.request.RequestTooLong` if it can never fit the KV pool
        (:meth:`refusal`), :class:`~jaxlab.serve.errors.QueueFull` or
        :class:`~jaxlab.serve.errors.NotAccepting`. Thread-safe."""
        problem = self.refusal(request)
        if problem is not None:
            from jaxlab.infer.request import RequestTooLong

            raise RequestTooLong(problem, param="prompt")
        entry = self._waiting.put(request, output)
        self.metrics.waiting.set(len(self._waiting))
        return entry.id

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` (no-op once it ended): it leaves the queue or its slot and
        pages are freed on the next step, and its output fails with ``Cancelled``.
        Thread-safe."""
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
                    if self._decoding():
                        wait = min(max(self._next_chunk_at - time.perf_counter(), 0.0), wait)
                    free = None in self._running and not self._blocked
                    self._waiting.sleep(wait, free=free)
                self._update_gauges()
        finally:  # stopped, or the loop itself crashed: nothing in flight is left waiting
            self._shutdown()

    def step(self) -> bool:
        """One iteration (module docstring); False when there was nothing to do."""
        if self._waiting.stopped:
            return False
        reaped = self._reap()
        prefilled = self._prefill()
        if self._decoding() and time.perf_counter() >= self._next_chunk_at:
            self._decode_chunk()
        elif self._inflight is not None:
            chunk, self._inflight = self._inflight, None
            self._route(chunk)
        else:
            return reaped or prefilled
        return True

    def _decoding(self) -> bool:
        return any(e is not None and e.decoding for e in self._running)

    def _reap(self) -> bool:
        """Fail the queued and running requests that were cancelled or timed out."""
        dropped, _ = self._waiting.poll(free=0)
        for entry, why in dropped:
            self._fail(entry, why)
        now = time.perf_counter()
        for entry in list(self._running):
            why = None if entry is None else self._waiting.expired(entry, now)
            if entry is not None and why is not None:
                self._fail(entry, why)
                dropped.append((entry, why))
        return bool(dropped)

    # ------------------------------------------------------------------ admission, prefill

    def _prefill(self) -> bool:
        """Admit and prefill until each slot group's prompt-token budget for the step is
        spent (:func:`plan_chunks`), nothing is left to prefill, or ``slots`` requests were
        admitted this step (requests that finish in prefill free their slot at once, and a
        stream of them must not starve the decoding ones). Requests that arrive meanwhile are admitted too, before the next decode
        chunk (prefill goes first, as vLLM's scheduler prefers prefills)."""
        budget = self.prefill_chunk_tokens or None
        spent: dict[int, int] = {}  # prompt tokens each slot group prefilled this step
        admitted, did = 0, False
        while not self._waiting.stopped:
            admitted += self._admit(self.slots - admitted)
            prefilling = sorted(
                (e for e in self._running if e is not None and not e.decoding),
                key=lambda e: e.order,
            )
            groups = [self._group(e).index for e in prefilling]
            plan = plan_chunks(
                [(g, len(e.seq) - e.computed) for g, e in zip(groups, prefilling, strict=True)],
                budget,
                self.prefill_batch,
                spent,
            )
            work = [(e, n) for e, n in zip(prefilling, plan, strict=True) if n > 0]
            if not work:
                break
            did = True
            self._run_chunks(work)
            for g, n in zip(groups, plan, strict=True):
                spent[g] = spent.get(g, 0) + n
        return did or admitted > 0

    def _admit(self, limit: int) -> int:
        """Take waiting requests, oldest first, while a slot is free and the head's pages fit
        a group's pool (it never jumps the queue: a long prompt is not starved by short
        ones). Returns how many were admitted."""
        taken = 0
        while taken < limit and None in self._running:
            dropped, head = self._waiting.poll(free=1)
            for entry, why in dropped:
                self._fail(entry, why)
            if not head:
                break
            if not self._place(head[0]):
                self._waiting.put_back(head)
                self._blocked = True
                break
            taken += 1
        if taken:  # the pages are held from now on, through the prefill that follows
            self._update_gauges()
        return taken

    def _place(self, entry: Entry) -> bool:
        """Give ``entry`` a slot and pages for its prompt (and the tokens it had generated,
        if it was preempted) plus one decode chunk, in the first group whose pool admits it
        (:func:`~jaxlab.serve.policy.slot_candidates`); False if none does."""
        req = entry.request
        seq = req.prompt_ids + tuple(entry.generated)
        cap = kv_tokens(len(req.prompt_ids), req.sampling.max_new_tokens)
        reserve = max(0, min(self.chunk_tokens, cap - len(seq)))
        for slot in slot_candidates([e is not None for e in self._running], self.groups.rows):
            g = self.groups.group_of(slot)
            admission = g.pool.admit(entry.id, seq, reserve, salt=adapter_salt(req.adapter))
            if admission is None:
                continue
            entry.slot, self._running[slot] = slot, entry
            entry.seq, entry.computed, entry.decoding = seq, admission.cached_tokens, False
            entry.order = next(self._admissions)
            if self.prefix_caching:
                self.metrics.prefix_queries.inc(len(seq))
                self.metrics.prefix_hits.inc(admission.cached_tokens)
            if entry.cached_tokens is None:  # its first admission
                entry.cached_tokens = admission.cached_tokens
                entry.output.admitted(admission.cached_tokens)
                try:  # its sampling values in the device's dtypes, kept for the prefill
                    _ = req.sampling.row
                except Exception as e:  # Request.create's checks keep a checked request out
                    log.error("preparing request %d failed: %s", entry.id, e)
                    self._fail(entry, EngineFailure(f"preparing the request failed: {e}"))
            return True
        return False

    def _group(self, entry: Entry) -> SlotGroup:
        assert entry.slot is not None
        return self.groups.group_of(entry.slot)

    def _chunk(self, entry: Entry, n: int) -> Chunk:
        from jaxlab.infer.chunks import Chunk

        start = entry.computed
        last = start + n == len(entry.seq)
        pages = self._group(entry).pool.pages(entry.id)
        tokens = entry.seq[start : start + n]
        req = entry.request
        return Chunk(tokens, start, pages, req.sampling, last, len(entry.generated), req.adapter)

    def _run_chunks(self, work: list[tuple[Entry, int]]) -> None:
        """Prefill ``work`` (``(request, tokens)``): one call per slot group (the engine
        pads its rows to a power of two); then commit the computed pages, and insert the
        requests whose prompt is complete.

        One request never fails another. When a batched call raises without having consumed
        the group's state, its requests are prefilled again one by one (1 row is a compiled
        size), so only the one at fault fails; a call that lost the state fails every
        running request, as a failed chunk does.
        """
        by_group: dict[int, list[tuple[Entry, int]]] = {}
        for entry, n in work:
            by_group.setdefault(self._group(entry).index, []).append((entry, n))
        done: list[tuple[SlotGroup, list[tuple[Entry, int]], Any]] = []
        for index, items in by_group.items():
            g = self.groups[index]
            parts = [items]
            while parts:
                part = parts.pop(0)
                try:
                    pre = g.prefill([self._chunk(e, n) for e, n in part])
                except Exception as e:
                    if g.state is None:
                        self._device_failed("prefill", e)
                        return
                    if len(part) > 1:
                        ids = [entry.id for entry, _ in part]
                        log.warning(
                            "prefill of requests %s failed (%r); prefilling each alone", ids, e
                        )
                        parts = [[item] for item in part] + parts
                        continue
                    log.exception("prefill failed for request %d", part[0][0].id)
                    self._fail(part[0][0], EngineFailure(f"prefill failed: {e}"))
                    continue
                done.append((g, part, pre))
        for g, part, pre in done:
            self._finish_prefill(g, part, pre)

    def _finish_prefill(self, g: SlotGroup, part: list[tuple[Entry, int]], pre: Any) -> None:
        """After one prefill call of group ``g``: commit each request's computed pages; put
        the rows whose prompt is complete into their slots (a row done already, by a stop
        token or a one-token budget, takes none) and report their first tokens."""
        import jax

        try:
            first, done = jax.device_get((pre.tokens, pre.done))
        except Exception as e:
            self._device_failed("prefill", e)
            return
        rows = [-1] * len(part)
        complete: list[tuple[int, Entry]] = []
        for i, (entry, n) in enumerate(part):
            if entry.slot is None:  # failed meanwhile
                continue
            entry.computed += n
            g.pool.commit(entry.id, entry.seq, entry.computed)
            if entry.computed == len(entry.seq):
                complete.append((i, entry))
                if not done[i]:
                    rows[i] = entry.slot - g.start
        if any(r >= 0 for r in rows):
            try:
                g.insert(pre, rows)
            except Exception as e:
                self._device_failed("insert", e)
                return
        for i, entry in complete:
            if rows[i] >= 0:
                entry.decoding = True
                g.table.set(rows[i], g.pool.pages(entry.id))
            self._emit(entry, [int(first[i])], bool(done[i]))

    # ------------------------------------------------------------------ decoding

    def _decode_chunk(self) -> None:
        """Make room for the next chunk (:meth:`_grow`), dispatch it, then route the one
        before it (module docstring)."""
        if not self._grow():
            return
        owners = [e if e is not None and e.decoding else None for e in self._running]
        if not any(owners):  # every decoding request was preempted or ended
            return
        try:
            ran = self.groups.generate([e is not None for e in owners], self.chunk_tokens)
        except Exception as e:
            self._device_failed("decode", e)
            return
        self.chunks += 1
        self._next_chunk_at = time.perf_counter() + self.chunk_delay_s
        previous, self._inflight = self._inflight, _Chunk(ran, owners)
        if previous is not None:
            self._route(previous)

    def _grow(self) -> bool:
        """Grow each decoding row's pages to cover the next chunk, oldest request first.

        When a group's pool runs dry, the chunk in flight is routed first (requests that
        finished give their pages back, and every token is known), then the group's newest
        request is preempted (vLLM's recompute preemption: :meth:`_preempt`), until the row
        fits or is itself the one preempted. The oldest request always fits: alone, any
        request fits its pool (:meth:`refusal` keeps out those that do not). False if a
        device call failed on the way.
        """
        for g in self.groups:
            for entry in sorted(self._in(g, decoding=True), key=lambda e: e.order):
                while entry.slot is not None and not g.pool.grow(entry.id, self._target(entry)):
                    if self._inflight is not None:
                        chunk, self._inflight = self._inflight, None
                        self._route(chunk)
                        continue
                    victim = max(self._in(g), key=lambda e: e.order)
                    if not self._preempt(victim):
                        return False
                if entry.slot is not None:
                    g.table.set(entry.slot - g.start, g.pool.pages(entry.id))
        return True

    def _in(self, g: SlotGroup, *, decoding: bool | None = None) -> list[Entry]:
        """The requests holding a slot of ``g`` (only the decoding ones, or only the ones
        being prefilled, if asked)."""
        return [
            e
            for e in self._running[g.start : g.start + g.rows]
            if e is not None and (decoding is None or e.decoding == decoding)
        ]

    def _target(self, entry: Entry) -> int:
        req = entry.request
        ahead = self._inflight is not None and any(o is entry for o in self._inflight.owners)
        position = len(req.prompt_ids) + len(entry.generated) - 1
        cap = kv_tokens(len(req.prompt_ids), req.sampling.max_new_tokens)
        return grow_target(position, self.chunk_tokens, int(ahead), cap)

    def _preempt(self, entry: Entry) -> bool:
        """Free ``entry``'s slot and pages and put it back at the head of the queue; it is
        recomputed from its prompt and the tokens it got (all routed: nothing of it is in
        flight), so its output continues where it stopped. False if freeing its row on the
        device failed."""
        log.info(
            "preempting request %d (%d tokens generated): its slot group's KV pool is full",
            entry.id,
            len(entry.generated),
        )
        ok = self._free(entry, on_device=True)
        self.preemptions += 1
        self.metrics.preemptions.inc()
        if not entry.finished:
            self._waiting.put_back([entry])
        return ok

    def _route(self, chunk: _Chunk) -> None:
        """Hand each row's new tokens to the request that owned the slot at dispatch."""
        import jax

        try:
            host = jax.device_get([(tokens, done, stats) for _, tokens, done, stats in chunk.ran])
        except Exception as e:
            self._device_failed("decode", e)
            return
        for (g, *_), (tokens, done, stats) in zip(chunk.ran, host, strict=True):
            for row, slot in enumerate(g.slots):
                entry = chunk.owners[slot]
                if entry is not None and not entry.finished and entry.slot == slot:
                    if stats is not None:
                        self._speculated(entry, stats, row)
                    self._emit(entry, [int(t) for t in tokens[:, row] if t >= 0], bool(done[row]))

    def _speculated(self, entry: Entry, stats: Any, row: int) -> None:
        """A speculating engine's counts for ``entry``'s row in one chunk: to the metrics and
        to its output (before its tokens, so a finished request reports them)."""
        drafted, accepted = int(stats.drafted[row]), int(stats.accepted[row])
        self.metrics.spec_draft_tokens.inc(drafted)
        self.metrics.spec_accepted_tokens.inc(accepted)
        entry.output.speculated(drafted, accepted, bool(stats.on[row]))

    # ------------------------------------------------------------------ ends of a request

    def _emit(self, entry: Entry, tokens: list[int], done: bool) -> None:
        """Report ``tokens`` to the request's output; end it if it is done or asks to."""
        if entry.finished:
            return
        if entry.cancelled:
            self._fail(entry, Cancelled(), on_device=not done)
            return
        entry.generated.extend(tokens)
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

    def _free(self, entry: Entry, *, on_device: bool) -> bool:
        """Free ``entry``'s slot and pages, if it holds them: on the host, and with
        ``on_device`` (for a row that is decoding) the device row too
        (:meth:`SlotGroup.free`, after the group's chunk in flight). False if that failed."""
        slot = entry.slot
        if slot is None:
            return True
        g = self.groups.group_of(slot)
        decoding = entry.decoding
        self._running[slot] = None
        entry.slot, entry.decoding = None, False
        g.pool.release(entry.id)
        g.table.clear(slot - g.start)
        self._blocked = False
        if on_device and decoding:
            try:
                g.free(slot - g.start)
            except Exception as e:
                self._device_failed("freeing a slot", e)
                return False
        return True

    def _device_failed(self, what: str, e: Exception) -> None:
        """A device call failed: the decode states it was given may be gone (donated), so
        every running request fails, every group starts afresh (state, pool and table) and
        the chunk in flight is dropped."""
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
        used, total = self.groups.pages_used, self.groups.pages_total
        m.pages_used.set(used)
        m.kv_usage.set(used / total)

    def _shutdown(self) -> None:
        self._waiting.set(accepting=False, stopped=True)
        pending = [*self._waiting.drain_all(), *(s for s in self._running if s is not None)]
        self._inflight = None
        for entry in pending:
            self._fail(entry, self._abort or ShuttingDown(), on_device=False)
        self.groups.close()
        self._update_gauges()


__all__ = ["PAD_TOKEN", "Output", "Scheduler", "adapter_salt"]
