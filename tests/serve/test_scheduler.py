"""The scheduler's loop against a fake engine: no model, no jax compile, milliseconds a test.

Most tests drive :meth:`Scheduler.step` from the test thread, so every interleaving is
deterministic; a few run the real loop on its thread (drain, stop, the service). Each
request's output is a :class:`Recorder` (what the scheduler reported, and whether to ask
it to finish early, as a stop string does) or a real
:class:`~jaxlab.serve.output.RequestStream`. After every test the fixture checks the slot
and page accounting (:func:`check_released`): no slot held on the host, every row empty
on the device, every pool consistent with no page held, and no page fault on the fake
device. The paged cache's own tests (admission by memory, preemption, chunked prefill,
prefix caching) are in ``test_paged_scheduler.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxlab.infer.request import Request
from jaxlab.infer.sampling import SamplingParams
from jaxlab.serve.errors import (
    Cancelled,
    EngineFailure,
    NotAccepting,
    QueueFull,
    RequestTimeout,
    ServeError,
    ShuttingDown,
)
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.output import RequestStream
from jaxlab.serve.scheduler import Scheduler
from jaxlab.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


class Recorder:
    """An :class:`~jaxlab.serve.scheduler.Output` that records what it is told;
    ``finish_after`` tokens in, it asks the scheduler to finish (as a stop string does)."""

    def __init__(self, finish_after: int | None = None) -> None:
        self.finish_after = finish_after
        self.admitted_n = 0
        self.emits: list[tuple[list[int], bool]] = []
        self.errors: list[ServeError] = []
        self.cached_tokens: int | None = None
        self.on_emit: Callable[[], None] | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for toks, _ in self.emits for t in toks]

    @property
    def ended(self) -> bool:
        asked = self.finish_after is not None and len(self.tokens) >= self.finish_after
        return bool(self.errors) or asked or any(done for _, done in self.emits)

    def admitted(self, cached_tokens: int) -> None:
        self.admitted_n += 1
        self.cached_tokens = cached_tokens

    def speculated(self, drafted: int, accepted: int, on: bool) -> None:
        raise AssertionError("the fake engine does not speculate")

    def emit(self, tokens: list[int], done: bool) -> bool:
        assert not self.ended, "tokens after the end"
        self.emits.append((list(tokens), done))
        if self.on_emit is not None:
            self.on_emit()
        return self.ended

    def fail(self, error: ServeError) -> None:
        assert not self.ended, "a failure after the end"
        self.errors.append(error)


def req(n: int, new: int, *, seed: int = 0, first: int = 1, stop: tuple[int, ...] = ()) -> Request:
    sp = SamplingParams(max_new_tokens=new, seed=seed, stop_token_ids=stop)
    return Request.create([first] * n, sp, FakeEngine().limits(TOK.eot_id))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make(engine: FakeEngine) -> Iterator[Callable[..., Scheduler]]:
    """``make(**kwargs)``: a warmed scheduler over ``engine`` (4 slots in 2 groups, admission
    groups up to 4, chunks of 4 steps); closed and slot-checked after the test."""
    made: list[Scheduler] = []

    def build(**kwargs: Any) -> Scheduler:
        args: dict[str, Any] = dict(
            slots=4, decode_groups=2, prefill_batch=4, max_queue=16, chunk_tokens=4
        )
        args["request_timeout_s"] = 60.0
        args.update(kwargs)
        sched = Scheduler(engine, **args)
        assert sched.warmup() is not None
        made.append(sched)
        return sched

    yield build
    for sched in made:
        if not sched._waiting.stopped:
            settle(sched)
            check_released(sched)
            sched.stop()
            sched.run()  # stopped: shuts down at once (closes the group threads)


def check_released(sched: Scheduler) -> None:
    """Nothing held: no slot on the host, every row empty on the device, every pool
    consistent and holding no page, and the fake device saw no page fault."""
    assert sched.idle and sched.num_running == 0
    for g in sched.groups:
        assert g.state is not None and g.state.done.all(), g.state
        g.pool.check()
        assert g.pool.used == 0, (g.index, g.pool.used)
        assert (g.table.array == g.no_page).all()
    engine = sched.engine
    assert isinstance(engine, FakeEngine) and engine.faults == []


def settle(sched: Scheduler, max_steps: int = 1000) -> int:
    """Step until nothing is queued, running or in flight; returns the steps taken."""
    for n in range(max_steps):
        if sched.idle and sched._inflight is None:
            return n
        sched.step()
    raise AssertionError("the scheduler did not settle")


def submit(sched: Scheduler, *reqs: Request, **kw: Any) -> list[Recorder]:
    outs = [Recorder(**kw) for _ in reqs]
    for r, o in zip(reqs, outs, strict=True):
        sched.submit(r, o)
    return outs


def verbs(engine: FakeEngine, since: int = 0) -> list[str]:
    return [f"{c[0]} {len(c[1])}" if c[0] == "prefill" else c[0] for c in engine.calls[since:]]


# ----------------------------------------------------------------------------- outputs


def test_warm_up_compiles_every_shape_and_serving_compiles_nothing(make, engine):
    sched = make()
    # prefill per (bucket, admission size), insert per admission size, one decode.
    assert sched.compiles_after_warmup == {"prefill": 2 * 3, "insert": 3, "generate": 1}
    reqs = [req(n, new, seed=i) for i, (n, new) in enumerate([(3, 9), (40, 2), (1, 1), (9, 20)])]
    outs = submit(sched, *reqs, req(17, 5), req(2, 30))
    settle(sched)
    assert all(o.emits and o.emits[-1][1] for o in outs)
    assert engine.compiles == sched.compiles_after_warmup


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.sampled_from([(1, 1, 1), (4, 2, 4), (4, 1, 2), (6, 3, 4), (8, 2, 8)]),
    plan=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 20), st.booleans()), min_size=1, max_size=14
    ),
)
def test_every_request_gets_what_it_gets_alone(engine, shape, plan):
    """Whatever the slots, groups, admission groups and the mix of lengths, budgets and
    stop tokens, each request's tokens equal the fake's reference for it alone, it ends
    exactly once, and every slot is free afterwards."""
    slots, groups, batch = shape
    sched = Scheduler(
        engine,
        slots=slots,
        decode_groups=groups,
        prefill_batch=batch,
        max_queue=64,
        request_timeout_s=60,
        chunk_tokens=3,
    )
    sched.warmup()
    try:
        reqs = []
        for i, (n, new, stop) in enumerate(plan):
            r = req(n, new, seed=i, first=i + 1)
            if stop:  # stop at the request's own third token (when it gets that far)
                r = req(n, new, seed=i, first=i + 1, stop=(engine.reference(r)[min(2, new - 1)],))
            reqs.append(r)
        outs = submit(sched, *reqs)
        settle(sched)
        for r, o in zip(reqs, outs, strict=True):
            assert o.tokens == engine.reference(r)
            assert [done for _, done in o.emits] == [False] * (len(o.emits) - 1) + [True]
            assert o.admitted_n == 1 and not o.errors
        assert sched.num_running == 0 and all(g.state.done.all() for g in sched.groups)
        assert engine.compiles == sched.compiles_after_warmup
    finally:
        sched.stop()
        sched.run()


def test_request_stream_strips_the_stop_token_and_cuts_at_a_stop_string(make, engine):
    sched = make()
    plain = req(4, 12, seed=3)
    tokens = engine.reference(plain)
    text = bytes(tokens).decode()
    by_token = req(4, 12, seed=3, stop=(tokens[5],))
    by_string = Request.create(plain.prompt_ids, plain.sampling, engine.limits(), stop=[text[3:5]])
    m = ServeMetrics()
    outs = [RequestStream(r, TOK, metrics=m, stream=True) for r in (plain, by_token, by_string)]
    for r, o in zip((plain, by_token, by_string), outs, strict=True):
        sched.submit(r, o)
    settle(sched)
    assert (outs[0].token_ids, outs[0].finish_reason) == (tokens, "length")
    cut = tokens.index(tokens[5])
    assert (outs[1].token_ids, outs[1].finish_reason) == (tokens[:cut], "stop")
    assert outs[2].output_text == text[: text.index(text[3:5])] and outs[2].finish_reason == "stop"
    for o in outs:
        events = []
        while not o._q.empty():  # type: ignore[union-attr]
            events.append(o.get())
        assert "".join(e.text for e in events) == o.output_text
        assert events[-1].kind == "done" and events[-1].finish_reason == o.finish_reason


# ----------------------------------------------------------------------------- admission


def test_waiting_requests_spread_over_the_groups_and_are_prefilled_per_group(make, engine):
    sched = make()
    sched.pause_admission()
    outs = submit(sched, req(30, 6), req(5, 8, seed=1), req(9, 4, seed=2))
    n = len(engine.calls)
    sched.resume_admission()
    sched.step()
    # They take slots 0, 2, 1 (least busy group, lowest free slot), pages in that group's
    # pool, and one prefill per group (its own decode state), oldest first: [30, 9] in
    # group 0, [5] in group 1; then one insert per group with the group's own rows ...
    assert [c[:2] for c in engine.calls[n : n + 4]] == [
        ("prefill", [30, 9]),
        ("prefill", [5]),
        ("insert", 2),
        ("insert", 2),
    ]
    assert [c[2] for c in engine.calls[n + 2 : n + 4]] == [[0, 1], [0]]
    # ... then one chunk per group, from its own thread.
    threads = {c[2] for c in engine.calls[n + 4 :] if c[0] == "generate"}
    assert threads == {"jaxlab-decode-0_0", "jaxlab-decode-1_0"}
    assert [o.admitted_n for o in outs] == [1, 1, 1]
    settle(sched)


def test_three_prompts_of_one_group_are_one_call(make, engine):
    """Three prompts admitted together into one slot group are one prefill call (the
    engine pads its rows to four) and one insert."""
    sched = make(decode_groups=1)
    sched.pause_admission()
    reqs = [req(30, 6), req(5, 8, seed=1), req(9, 4, seed=2)]
    outs = submit(sched, *reqs)
    n = len(engine.calls)
    sched.resume_admission()
    sched.step()
    assert engine.calls[n][:2] == ("prefill", [30, 5, 9]) and engine.calls[n][3] == 4
    assert engine.calls[n + 1] == ("insert", 4, [0, 1, 2])
    settle(sched)
    assert [o.tokens for o in outs] == [engine.reference(r) for r in reqs]


def test_a_request_done_in_prefill_takes_no_slot(make, engine):
    sched = make(slots=1, decode_groups=1)
    one, long = submit(sched, req(3, 1), req(3, 5, seed=1))
    sched.step()
    assert one.emits == [([engine.reference(req(3, 1))[0]], True)]
    assert sched.num_running == 0  # its slot stayed free (one admission per slot a step)
    sched.step()
    assert sched.num_running == 1  # the second one holds the only slot
    settle(sched)
    assert long.tokens == engine.reference(req(3, 5, seed=1))


def test_requests_arriving_during_a_prefill_are_admitted_before_the_next_chunk(make, engine):
    sched = make()
    late: list[Recorder] = []

    def arrive() -> None:  # two more arrive while the first one is being admitted
        if not late:
            late.extend(submit(sched, req(9, 10, seed=3), req(4, 11, seed=4)))

    first = Recorder()
    first.on_emit = arrive
    n = len(engine.calls)
    sched.submit(req(6, 12), first)
    sched.step()
    calls = [c for c in verbs(engine, n) if c != "set_table"]
    # The first in group 0; the two late ones, one in each group: one prefill per group.
    assert calls[:6] == ["prefill 1", "insert", "prefill 1", "prefill 1", "insert", "insert"]
    assert "prefill" not in " ".join(calls[6:]), calls
    settle(sched)
    assert late[0].tokens == engine.reference(req(9, 10, seed=3))
    assert first.tokens == engine.reference(req(6, 12))


def test_requests_done_in_prefill_cannot_starve_decoding(make, engine):
    """Prefill goes first, but at most ``slots`` admissions per step: one-token requests
    that keep arriving during each other's prefills still let the decoding one advance."""
    sched = make()
    flood: list[Recorder] = []

    def more() -> None:  # each emit (each admission, each chunk) brings the next one
        if len(flood) < 12:
            flood.extend(submit(sched, req(3, 1, seed=len(flood))))
            flood[-1].on_emit = more

    n = len(engine.calls)
    long = Recorder()
    sched.submit(req(5, 40), long)
    sched.step()
    long.on_emit = more
    more()
    settle(sched)
    assert len(flood) == 12 and all(len(o.tokens) == 1 and o.emits[-1][1] for o in flood)
    # Requests admitted between two chunks (prefill rows, padding rows left out).
    admitted, between = [0], engine.calls[n:]
    for call in between:
        if call[0] == "generate" and admitted[-1]:
            admitted.append(0)
        elif call[0] == "prefill":
            admitted[-1] += sum(length > 1 for length in call[1])
    assert max(admitted) == sched.slots, admitted  # the bound was reached, and held
    assert long.tokens == engine.reference(req(5, 40))


# ----------------------------------------------------------------------------- ends


def test_cancel_while_queued_and_while_running_frees_the_slot(make, engine):
    sched = make()
    running, queued = Recorder(), Recorder()
    rid = sched.submit(req(3, 50), running)
    sched.step()
    sched.pause_admission()
    qid = sched.submit(req(3, 50, seed=1), queued)
    sched.step()
    sched.cancel(qid)
    sched.step()
    assert isinstance(queued.errors[0], Cancelled) and queued.admitted_n == 0
    assert running.emits and sched.num_running == 1
    emitted = len(running.emits)
    sched.cancel(rid)
    sched.step()
    assert isinstance(running.errors[0], Cancelled) and sched.num_running == 0
    assert sched.groups[0].state.done.all()  # emptied on the device too
    assert len(running.emits) == emitted  # nothing after the cancel
    sched.cancel(rid)  # again, and an unknown id: no-ops
    sched.cancel(999)
    sched.resume_admission()


def test_timeouts_while_queued_and_while_running(make, engine):
    sched = make(request_timeout_s=0.05)
    sched.chunk_delay_s = 10.0  # one chunk, then none for the test's duration
    running, queued = Recorder(), Recorder()
    sched.submit(req(3, 50), running)
    sched.step()
    sched.pause_admission()
    sched.submit(req(3, 50, seed=1), queued)
    time.sleep(0.06)
    sched.step()
    assert isinstance(running.errors[0], RequestTimeout)
    assert "request_timeout_s = 0.05s" in str(running.errors[0])
    assert isinstance(queued.errors[0], RequestTimeout) and queued.admitted_n == 0
    assert sched.num_running == 0 and sched.groups[0].state.done.all()
    sched.resume_admission()


def test_a_stop_string_finish_frees_the_slot_at_once_and_late_tokens_are_ignored(make, engine):
    """Pipelining: chunk ``i + 1`` is dispatched before chunk ``i`` is routed. A request
    that asks to finish while routing chunk ``i`` gets nothing of chunk ``i + 1``, its slot
    is emptied on the device right away, and a request admitted into that slot does not
    get the rows computed for the one before it."""
    sched = make(slots=1, decode_groups=1)
    a = Recorder(finish_after=3)  # prefill's token, then the first chunk's
    sched.submit(req(3, 50), a)
    sched.step()  # admit; dispatch chunk 1
    sched.step()  # dispatch chunk 2, route chunk 1: a finishes
    assert a.ended and len(a.emits) == 2 and sched.num_running == 0
    assert sched.groups[0].state.done.all()  # the row emptied after chunk 2
    b = Recorder()
    sched.submit(req(4, 6, seed=9), b)
    settle(sched)  # routes chunk 2 (a's row, ignored), then b's own chunks
    assert len(a.emits) == 2
    assert b.tokens == engine.reference(req(4, 6, seed=9))


def test_output_processing_that_raises_fails_only_its_request(make, engine):
    sched = make()
    bad, good = submit(sched, req(3, 20), req(4, 20, seed=1))

    def broken() -> None:
        raise ValueError("detok broke")

    bad.on_emit = broken
    settle(sched)
    assert isinstance(bad.errors[0], EngineFailure) and "detok broke" in str(bad.errors[0])
    assert good.tokens == engine.reference(req(4, 20, seed=1))


@pytest.mark.parametrize("verb", ["prefill", "insert", "generate"])
def test_engine_failures_fail_the_affected_requests_and_serving_goes_on(make, engine, verb):
    """A failed prefill of one request fails it; a failed insert or chunk fails every
    running request (the fixture checks every slot is free after). Serving goes on."""
    sched = make()
    before = submit(sched, req(3, 30))
    sched.step()
    engine.fail_next(verb)
    hit = submit(sched, req(5, 30, seed=1))
    settle(sched)
    failed = [o for o in [*before, *hit] if o.errors]
    assert failed and all(isinstance(o.errors[0], EngineFailure) for o in failed)
    assert f"{verb} broke" in str(failed[0].errors[0])
    if verb == "prefill":  # no decode state was touched: the running request goes on
        assert not before[0].errors and before[0].tokens == engine.reference(req(3, 30))
    else:  # a donated state was lost: every running request fails, its slot is free
        assert failed == [*before, *hit]
    after = submit(sched, req(7, 9, seed=2))
    settle(sched)
    assert after[0].tokens == engine.reference(req(7, 9, seed=2))


def prefills(engine: FakeEngine, since: int) -> list[list[int]]:
    """The prompt lengths of each prefill since call ``since``."""
    return [c[1] for c in engine.calls[since:] if c[0] == "prefill"]


def unpreparable(n: int, new: int, *, first: int) -> Request:
    """A request whose top_k no int32 holds: built without ``Request.create``'s check, as
    a library caller could."""
    return Request((first,) * n, SamplingParams(max_new_tokens=new, top_k=2**40))


def test_a_prefill_that_fails_for_one_request_fails_it_alone(make, engine):
    """The batched prefill raises because of one prompt: its requests are prefilled again
    one by one, so only that one fails and the others get what they get alone."""
    sched = make(decode_groups=1)
    sched.pause_admission()
    reqs = [req(3, 9, first=1), req(5, 9, seed=2, first=2), req(4, 9, seed=3, first=3)]
    reqs.append(req(6, 9, seed=4, first=4))
    engine.fail_prompt(reqs[2].prompt_ids)
    outs = submit(sched, *reqs)
    n = len(engine.calls)
    sched.resume_admission()
    settle(sched)
    assert isinstance(outs[2].errors[0], EngineFailure)
    assert "prefill failed: prefill broke on a poisoned prompt" in str(outs[2].errors[0])
    for r, o in zip(reqs, outs, strict=True):
        if o is not outs[2]:
            assert o.tokens == engine.reference(r) and not o.errors
        assert o.admitted_n == 1
    # One batch of 4 (oldest first), then each alone: shapes the warm-up compiled.
    assert prefills(engine, n) == [[3, 5, 4, 6], [3], [5], [4], [6]]
    assert engine.compiles == sched.compiles_after_warmup


def test_a_request_that_cannot_be_prepared_fails_alone_before_its_batch(make, engine):
    """A value no device dtype holds fails its own request on the host, before the
    batched prefill, which the others share as if it had never been there."""
    sched = make(decode_groups=1)
    sched.pause_admission()
    good = [req(3, 9, first=1), req(5, 9, seed=2, first=2)]
    outs = submit(sched, good[0], unpreparable(3, 9, first=3), good[1])
    n = len(engine.calls)
    sched.resume_admission()
    settle(sched)
    assert isinstance(outs[1].errors[0], EngineFailure)
    assert "top_k = 1099511627776 does not fit int32" in str(outs[1].errors[0])
    assert outs[0].tokens == engine.reference(good[0])
    assert outs[2].tokens == engine.reference(good[1])
    assert prefills(engine, n) == [[3, 5]]  # its slot and pages went to the next one


@settings(max_examples=25, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 12), st.sampled_from(["ok", "ok", "bad"])),
        min_size=1,
        max_size=10,
    ),
    poison=st.booleans(),
    cut=st.integers(0, 10),
)
def test_bad_requests_fail_alone_whatever_the_batch(plan, poison, cut):
    """Whatever the mix, a request whose prefill fails (``poison``) or which cannot be
    prepared fails alone, with an EngineFailure; every other one gets what it gets alone,
    every slot is free afterwards, and nothing compiles."""
    engine = FakeEngine()
    sched = Scheduler(
        engine,
        slots=4,
        decode_groups=2,
        prefill_batch=4,
        max_queue=16,
        request_timeout_s=60,
        chunk_tokens=3,
    )
    sched.warmup()
    try:
        reqs, bad = [], []
        for i, (n, new, fate) in enumerate(plan):
            if fate == "bad" and not poison:
                reqs.append(unpreparable(n, new, first=i + 1))
            else:
                reqs.append(req(n, new, seed=i, first=i + 1))
                if fate == "bad":
                    engine.fail_prompt(reqs[-1].prompt_ids)
            bad.append(fate == "bad")
        outs = submit(sched, *reqs[:cut])
        sched.step()  # the rest arrive while these run
        outs += submit(sched, *reqs[cut:])
        settle(sched)
        for r, o, failed in zip(reqs, outs, bad, strict=True):
            if failed:
                assert len(o.errors) == 1 and isinstance(o.errors[0], EngineFailure), o.errors
            else:
                assert o.tokens == engine.reference(r) and not o.errors
        assert sched.num_running == 0 and all(g.state.done.all() for g in sched.groups)
        assert engine.compiles == sched.compiles_after_warmup
    finally:
        sched.stop()
        sched.run()


def test_a_failed_free_fails_the_running_requests_and_serving_goes_on(make, engine):
    """A failed insert took a donated state with it: every running request fails (its
    tokens could no longer come), every group starts afresh, and new requests are served."""
    sched = make()
    a, b = submit(sched, req(3, 60, first=1), req(3, 60, first=2))
    sched.step()  # a in slot 0 (group 0), b in slot 2 (group 1)
    engine.fail_next("insert")
    sched.cancel(1)
    sched.step()
    assert isinstance(a.errors[0], Cancelled)
    assert isinstance(b.errors[0], EngineFailure) and "freeing a slot failed" in str(b.errors[0])
    after = submit(sched, req(7, 9, seed=2))
    settle(sched)
    assert after[0].tokens == engine.reference(req(7, 9, seed=2))


def test_a_request_cancelled_while_admitted_ends_at_once(make, engine):
    """Cancelled between leaving the queue and its first token (here: during its own
    prefill), a request ends there, even one that finished in prefill and holds no slot."""
    sched = make()
    outs = [Recorder(), Recorder()]
    ids = [sched.submit(req(3, 1), outs[0]), sched.submit(req(4, 30, seed=1), outs[1])]
    prefill = engine.prefill

    def cancelling(*args: Any, **kwargs: Any) -> Any:
        for rid in ids:
            sched.cancel(rid)
        return prefill(*args, **kwargs)

    engine.prefill = cancelling  # type: ignore[method-assign]
    try:
        sched.step()
    finally:
        del engine.prefill
    assert all(isinstance(o.errors[0], Cancelled) and not o.emits for o in outs)
    assert sched.num_running == 0


# ----------------------------------------------------------------------------- admission control


def test_queue_full_and_not_accepting(make, engine):
    sched = make(max_queue=2)
    sched.pause_admission()
    submit(sched, req(2, 3), req(2, 3))
    with pytest.raises(QueueFull, match=r"2 waiting = serve\.max_queue"):
        sched.submit(req(2, 3), Recorder())
    sched.close_admission()
    with pytest.raises(NotAccepting) as e:
        sched.submit(req(2, 3), Recorder())
    assert e.value.state == "draining"
    sched.resume_admission()
    settle(sched)  # what was queued still runs


def _looping(engine: FakeEngine) -> tuple[Scheduler, threading.Thread]:
    sched = Scheduler(
        engine, slots=2, max_queue=8, request_timeout_s=60, chunk_tokens=2, decode_groups=1
    )
    sched.warmup()
    loop = threading.Thread(target=sched.run, name="jaxlab-engine")
    loop.start()
    return sched, loop


def test_the_loop_thread_drains_what_it_accepted(engine):
    sched, loop = _looping(engine)
    try:
        outs = submit(sched, req(3, 7), req(4, 5, seed=1), req(5, 9, seed=2))
        sched.close_admission()
        with pytest.raises(NotAccepting):
            sched.submit(req(3, 3), Recorder())
        t_end = time.perf_counter() + 10
        while not sched.idle and time.perf_counter() < t_end:
            time.sleep(0.002)
        assert sched.idle
        for o, r in zip(outs, [req(3, 7), req(4, 5, seed=1), req(5, 9, seed=2)], strict=True):
            assert o.tokens == engine.reference(r) and o.emits[-1][1]
    finally:
        sched.stop()
        loop.join(10)
    assert not loop.is_alive()


def test_a_stop_fails_what_is_queued_and_running(engine):
    sched, loop = _looping(engine)
    engine.gate.clear()  # the device stalls: the first chunk never returns
    try:
        outs = submit(sched, req(3, 50), req(3, 50, seed=1), req(3, 50, seed=2))
        t_end = time.perf_counter() + 10
        while not any(c[0] == "generate" for c in engine.calls[-3:]):
            assert time.perf_counter() < t_end
            time.sleep(0.002)
        sched.stop()
    finally:
        engine.gate.set()
        loop.join(10)
    assert not loop.is_alive()
    assert all(isinstance(o.errors[0], ShuttingDown) for o in outs)
    assert sched.num_running == 0 and sched.num_waiting == 0
