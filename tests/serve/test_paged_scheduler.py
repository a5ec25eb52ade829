"""The scheduler over a paged KV cache, against the paged fake engine: admission by memory,
recompute preemption, chunked prefill, prefix caching, and pages freed on every path.

The fake (:mod:`fake_engine`) keeps K/V as a hash chain in its pages and samples each
token from what it reads back, so a request's tokens equal its solo reference only if
every page it read held exactly its own prefix; a read of a page it does not own, or a
write the host made no room for, is a :class:`~fake_engine.PageFault`. Every test ends
with :func:`~test_scheduler.check_released` (nothing held, no fault).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_scheduler import Recorder, check_released, settle, submit

from jaxlab.infer.request import Request, RequestTooLong
from jaxlab.infer.sampling import SamplingParams
from jaxlab.serve.errors import Cancelled, EngineFailure, RequestTimeout, ShuttingDown
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.scheduler import Scheduler
from jaxlab.tokenizer import byte_tokenizer

TOK = byte_tokenizer()


def build(engine: FakeEngine, **kwargs: Any) -> Scheduler:
    """A warmed scheduler: 4 slots in 1 group, chunks of 4 steps, unless told otherwise."""
    args: dict[str, Any] = dict(
        slots=4, decode_groups=1, prefill_batch=4, max_queue=64, chunk_tokens=4
    )
    args["request_timeout_s"] = 60.0
    args.update(kwargs)
    sched = Scheduler(engine, **args)
    assert sched.warmup() is not None
    return sched


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()  # max_len 64, pages of 4 tokens


@pytest.fixture
def made(engine: FakeEngine) -> Iterator[list[Scheduler]]:
    """Schedulers built by a test: settled, checked for leaks and closed after it."""
    out: list[Scheduler] = []
    yield out
    for sched in out:
        if not sched._waiting.stopped:
            settle(sched)
            check_released(sched)
            sched.stop()
            sched.run()


def prompt(n: int, first: int = 1, *, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    """``prefix``, then ``n - len(prefix)`` distinct-ish tokens starting at ``first``."""
    body = tuple((first + i) % 90 + 1 for i in range(n - len(prefix)))
    return (prefix + body)[:n]


def request(ids: tuple[int, ...], new: int, seed: int = 0) -> Request:
    sp = SamplingParams(max_new_tokens=new, seed=seed)
    return Request.create(ids, sp, FakeEngine().limits(TOK.eot_id))


def step_checked(sched: Scheduler) -> bool:
    """One step, then every pool's invariants, and the pages each request holds."""
    did = sched.step()
    for g in sched.groups:
        g.pool.check()
        for entry in sched._running[g.start : g.start + g.rows]:
            if entry is not None:
                assert entry.id in g.pool
    return did


def settle_checked(sched: Scheduler, max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if sched.idle and sched._inflight is None:
            return
        step_checked(sched)
    raise AssertionError("the scheduler did not settle")


# ----------------------------------------------------------------------------- admission


def test_a_request_that_can_never_fit_the_pool_is_refused_at_submit(engine, made):
    """8 pages over 2 groups: each group's pool holds 4 pages of 4 tokens. A request that
    needs more is refused before it queues, naming the limit; one that fits exactly runs,
    alone in its group."""
    sched = build(engine, num_pages=8, decode_groups=2)
    made.append(sched)
    assert sched.group_pages == 4
    too_big = request(prompt(10), 7)
    with pytest.raises(RequestTooLong) as e:
        sched.submit(too_big, Recorder())
    assert e.value.param == "prompt"
    assert "= 17 tokens needs 5 KV-cache pages of 4 tokens" in str(e.value)
    assert "a slot group's pool holds (4: 8 pages over 2 slot groups" in str(e.value)
    assert "inference.num_pages" in str(e.value)
    assert sched.num_waiting == 0
    fits = request(prompt(10), 6)
    (out,) = submit(sched, fits)
    settle_checked(sched)
    assert out.tokens == engine.reference(fits)


def test_admission_waits_for_pages_not_only_for_a_slot(engine, made):
    """Four free slots, but pages for two prompts: the first two are admitted, the others
    wait at the head of the queue (in order) until pages come back, and all finish."""
    sched = build(engine, num_pages=12)  # 48 tokens
    made.append(sched)
    reqs = [request(prompt(16, 10 * i), 6, seed=i) for i in range(4)]
    outs = submit(sched, *reqs)
    step_checked(sched)
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert [o.admitted_n for o in outs] == [1, 1, 0, 0]
    settle_checked(sched)
    assert [o.tokens for o in outs] == [engine.reference(r) for r in reqs]
    assert sched.preemptions == 0


# ----------------------------------------------------------------------------- preemption


def test_preemption_recomputes_and_the_stream_has_no_gap_or_duplicate(engine, made):
    """A pool for two long sequences, four requests that each grow long: the newest is
    preempted when the pool runs dry (pages and slot freed, requeued at the head),
    recomputed from its prompt and the tokens it got, and continues with the next token:
    every output equals its solo reference, admitted once, ended once."""
    metrics = ServeMetrics()
    sched = build(engine, num_pages=24, metrics=metrics)  # 96 tokens: two of 48
    made.append(sched)
    reqs = [request(prompt(8, 7 * i), 40, seed=i) for i in range(4)]
    outs = submit(sched, *reqs)
    settle_checked(sched)
    assert sched.preemptions > 0
    assert metrics.preemptions._value.get() == sched.preemptions
    for r, o in zip(reqs, outs, strict=True):
        assert o.tokens == engine.reference(r)
        assert o.admitted_n == 1 and [done for _, done in o.emits][-1]
        assert not o.errors


def test_a_preempted_request_in_the_middle_of_its_prefill_starts_over(engine, made):
    """Preemption takes the newest request, even one whose prompt is half prefilled
    (chunked): its pages go back, and it is prefilled again when readmitted."""
    sched = build(engine, num_pages=16, prefill_chunk_tokens=8)  # 64 tokens
    made.append(sched)
    old = request(prompt(6, 3), 50)
    (old_out,) = submit(sched, old)
    step_checked(sched)
    late = request(prompt(40, 40), 4, seed=1)
    n = len(engine.calls)
    (late_out,) = submit(sched, late)
    settle_checked(sched)
    assert old_out.tokens == engine.reference(old)
    assert late_out.tokens == engine.reference(late)
    assert sched.preemptions >= 1
    starts = [c[2] for c in engine.calls[n:] if c[0] == "prefill"]
    restart = starts.index([0], 1)  # its first chunk again: it started over
    assert [8] in starts[:restart] and starts[restart:][:5] == [[0], [8], [16], [24], [32]]


# ----------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_splits_a_long_prompt_between_decode_chunks(engine, made):
    """With serve.prefill_chunk_tokens = 8, a 40-token prompt is prefilled 8 tokens a step
    (chunks at 0, 8, .., 32) while the running request decodes a chunk every step in
    between; both get their solo answers, and nothing compiles after warm-up."""
    sched = build(engine, prefill_chunk_tokens=8)
    made.append(sched)
    running = request(prompt(5, 2), 40)
    (run_out,) = submit(sched, running)
    step_checked(sched)
    n = len(engine.calls)
    long = request(prompt(40, 9), 5, seed=3)
    (long_out,) = submit(sched, long)
    settle_checked(sched)
    calls = [c for c in engine.calls[n:] if c[0] in ("prefill", "generate")]
    prefills = [(c[1], c[2]) for c in calls if c[0] == "prefill"]
    assert prefills[:5] == [([8], [s]) for s in (0, 8, 16, 24, 32)]
    kinds = "".join(c[0][0] for c in calls)
    assert kinds.startswith("pgpgpgpgpg"), kinds  # a decode chunk after every prefill chunk
    assert run_out.tokens == engine.reference(running)
    assert long_out.tokens == engine.reference(long)
    assert engine.compiles == sched.compiles_after_warmup


def test_chunked_prefill_packs_short_prompts_into_one_call(engine, made):
    """Four 3-token prompts fit one 16-token budget: one prefill call of four rows."""
    sched = build(engine, prefill_chunk_tokens=16)
    made.append(sched)
    sched.pause_admission()
    reqs = [request(prompt(3, 11 * i), 6, seed=i) for i in range(4)]
    outs = submit(sched, *reqs)
    n = len(engine.calls)
    sched.resume_admission()
    settle_checked(sched)
    prefills = [c[1] for c in engine.calls[n:] if c[0] == "prefill"]
    assert prefills == [[3, 3, 3, 3]]
    assert [o.tokens for o in outs] == [engine.reference(r) for r in reqs]


@settings(max_examples=20, deadline=None)
@given(
    budget=st.sampled_from([0, 1, 3, 8, 16, 64]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
)
def test_chunked_prefill_equals_unchunked(budget, lengths):
    """Whatever the budget, each output equals its solo answer, no prefill call computes
    more than the budget's prompt tokens, and nothing compiles after warm-up."""
    engine = FakeEngine()
    sched = build(engine, prefill_chunk_tokens=budget)
    try:
        reqs = [request(prompt(n, 5 * i), min(12, 64 - n), seed=i) for i, n in enumerate(lengths)]
        n_calls = len(engine.calls)
        outs = submit(sched, *reqs)
        settle_checked(sched)
        assert [o.tokens for o in outs] == [engine.reference(r) for r in reqs]
        for call in engine.calls[n_calls:]:
            if call[0] == "prefill" and budget:
                assert sum(call[1]) <= budget, call
        check_released(sched)
        assert engine.compiles == sched.compiles_after_warmup
    finally:
        sched.stop()
        sched.run()


# ----------------------------------------------------------------------------- prefix caching


def test_prefix_caching_reuses_full_prompt_pages(engine, made):
    """A second prompt sharing 10 tokens with the first reuses its two full pages (8
    tokens): its prefill starts at 8, its output reports 8 cached tokens, the counters say
    so in tokens, and both equal their solo answers."""
    metrics = ServeMetrics()
    sched = build(engine, prefix_caching=True, metrics=metrics)
    made.append(sched)
    shared = prompt(10, 30)
    a = request(prompt(14, 1, prefix=shared), 5)
    b = request(prompt(13, 50, prefix=shared), 6, seed=2)
    (a_out,) = submit(sched, a)
    settle_checked(sched)
    n = len(engine.calls)
    (b_out,) = submit(sched, b)
    settle_checked(sched)
    (pre,) = [c for c in engine.calls[n:] if c[0] == "prefill"]
    assert pre[1:3] == ([5], [8])  # 13 - 8 tokens, from position 8
    assert (a_out.cached_tokens, b_out.cached_tokens) == (0, 8)
    assert metrics.prefix_queries._value.get() == 14 + 13
    assert metrics.prefix_hits._value.get() == 8
    assert a_out.tokens == engine.reference(a) and b_out.tokens == engine.reference(b)
    assert engine.compiles == sched.compiles_after_warmup


def test_a_whole_cached_prompt_still_computes_its_last_token(engine, made):
    """The same 12-token prompt twice: at most two of its three full pages are served from
    the cache, so its last token is computed (its logits give the first new token)."""
    sched = build(engine, prefix_caching=True)
    made.append(sched)
    r = request(prompt(12, 4), 5)
    first, again = Recorder(), Recorder()
    sched.submit(r, first)
    settle_checked(sched)
    sched.submit(r, again)
    settle_checked(sched)
    assert again.cached_tokens == 8
    assert first.tokens == again.tokens == engine.reference(r)


# ----------------------------------------------------------------------------- every path frees


def test_pages_and_slots_are_freed_on_every_path(engine, made):
    """Cancelled while queued, while half prefilled and while decoding; timed out; a
    failed output; a failed prefill: each leaves no slot and no page behind."""
    sched = build(engine, prefill_chunk_tokens=4, decode_groups=2, slots=4)
    made.append(sched)
    decoding, prefilling = Recorder(), Recorder()
    d = sched.submit(request(prompt(4, 1), 50), decoding)
    step_checked(sched)
    p = sched.submit(request(prompt(30, 9), 5, seed=1), prefilling)
    step_checked(sched)  # 4 of its 30 tokens prefilled
    assert sched.num_running == 2
    sched.cancel(p)
    sched.cancel(d)
    step_checked(sched)
    assert isinstance(prefilling.errors[0], Cancelled) and isinstance(decoding.errors[0], Cancelled)
    assert sched.groups.pages_used == 0 and sched.num_running == 0
    broken = Recorder()

    def fail() -> None:
        raise ValueError("detok broke")

    broken.on_emit = fail
    sched.submit(request(prompt(6, 2), 20, seed=2), broken)
    engine.fail_prompt(prompt(5, 77))
    (poisoned,) = submit(sched, request(prompt(5, 77), 20, seed=3))
    settle_checked(sched)
    assert isinstance(broken.errors[0], EngineFailure)
    assert isinstance(poisoned.errors[0], EngineFailure)
    assert sched.groups.pages_used == 0


def test_a_timeout_frees_pages(engine, made):
    sched = build(engine, request_timeout_s=0.05)
    made.append(sched)
    sched.chunk_delay_s = 10.0
    (out,) = submit(sched, request(prompt(9, 3), 50))
    step_checked(sched)
    assert sched.groups.pages_used > 0
    time.sleep(0.06)
    step_checked(sched)
    assert isinstance(out.errors[0], RequestTimeout)
    assert sched.groups.pages_used == 0


def test_a_stop_frees_pages_of_queued_running_and_preempted_requests(engine):
    sched = build(engine, num_pages=24, prefill_chunk_tokens=8)
    outs = submit(sched, *[request(prompt(8, 7 * i), 40, seed=i) for i in range(5)])
    for _ in range(12):
        step_checked(sched)
    sched.stop()
    sched.run()
    for o in outs:
        assert isinstance(o.errors[0], ShuttingDown) if o.errors else o.emits[-1][1]
    assert sched.num_running == 0 and sched.num_waiting == 0
    for g in sched.groups:
        g.pool.check()
        assert g.pool.used == 0
    assert engine.faults == []


def test_a_failed_chunk_resets_the_pools(engine, made):
    """A failed decode chunk took the group states with it: every running request fails,
    and each group starts with a fresh, empty pool (cached pages went with the state)."""
    sched = build(engine, prefix_caching=True, decode_groups=2)
    made.append(sched)
    outs = submit(sched, request(prompt(9, 1), 30), request(prompt(9, 1), 30, seed=1))
    step_checked(sched)
    engine.fail_next("generate")
    settle_checked(sched)
    assert all(isinstance(o.errors[0], EngineFailure) for o in outs)
    for g in sched.groups:
        assert g.pool.used == 0 and g.pool.free == g.num_pages
    after = request(prompt(9, 1), 6)
    (out,) = submit(sched, after)
    settle_checked(sched)
    assert out.tokens == engine.reference(after) and out.cached_tokens == 0


# ----------------------------------------------------------------------------- gauges


def test_page_gauges_and_usage_ratio(engine, made):
    metrics = ServeMetrics()
    sched = build(engine, num_pages=20, decode_groups=2, metrics=metrics)
    made.append(sched)
    assert metrics.pages_total._value.get() == 20
    submit(sched, request(prompt(9, 1), 20))
    step_checked(sched)
    sched._update_gauges()
    used = sched.groups.pages_used
    assert used == 3 + 1  # 9 prompt tokens and one chunk of 4: 13 tokens, 4 pages
    assert metrics.pages_used._value.get() == used
    assert metrics.kv_usage._value.get() == used / 20
    settle(sched)
    sched._update_gauges()
    assert metrics.kv_usage._value.get() == 0


def test_page_gauges_count_an_admission_before_its_prefill_runs(engine, made):
    """A long prefill must not read as an empty cache: admission itself moves the gauges."""
    metrics = ServeMetrics()
    sched = build(engine, num_pages=20, metrics=metrics)
    made.append(sched)
    submit(sched, request(prompt(9, 1), 20))
    assert sched._admit(1) == 1  # pages held, nothing computed yet
    assert sched.groups.pages_used == 4
    assert metrics.pages_used._value.get() == 4
    assert metrics.running._value.get() == 1
    settle(sched)


# ----------------------------------------------------------------------------- the property


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    """A small server (slots, groups, a pool of a few pages, chunking, caching) and a
    stream of requests over a few shared prefixes, each arriving at some step, some
    cancelled at a later one. Most requests fit a group's pool alone (a few never do),
    and together they overflow it, so requests wait for pages and get preempted."""
    slots, groups = draw(st.sampled_from([(1, 1), (2, 1), (4, 1), (4, 2)]))
    group_pages = draw(st.integers(4, 16))
    room = min(64, group_pages * 4)  # tokens a group's pool holds (pages of 4)
    prefixes = [prompt(draw(st.integers(0, 12)), 13 * i) for i in range(3)]
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        pre = prefixes[draw(st.integers(0, 2))]
        limit = 64 if draw(st.integers(0, 9)) == 0 else room
        n = draw(st.integers(1, max(1, limit - 1)))
        new = draw(st.integers(1, max(1, min(limit, 64) - n)))
        arrive = draw(st.integers(0, 8))
        cancel = draw(st.one_of(st.none(), st.none(), st.integers(arrive, arrive + 30)))
        reqs.append((prompt(n, 50 + 7 * i, prefix=pre[:n]), new, arrive, cancel))
    return dict(
        slots=slots,
        groups=groups,
        pages=group_pages * groups,
        chunk=draw(st.sampled_from([0, 4, 16])),
        caching=draw(st.booleans()),
        k=draw(st.sampled_from([1, 3, 4])),
        reqs=reqs,
    )


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(w=workloads())
def test_every_request_completes_as_alone_or_is_cancelled_and_no_page_leaks(w):
    """Random arrivals, cancellations, lengths and budgets on a small pool: each request
    either is refused at submit (it can never fit), or completes equal to its solo answer,
    or is cancelled; the pools are consistent after every step, nothing leaks, no page is
    read that its reader does not own, and nothing compiles after warm-up."""
    engine = FakeEngine()
    sched = build(
        engine,
        slots=w["slots"],
        decode_groups=w["groups"],
        prefill_batch=w["slots"],
        num_pages=w["pages"],
        prefill_chunk_tokens=w["chunk"],
        prefix_caching=w["caching"],
        chunk_tokens=w["k"],
    )
    try:
        fates: list[tuple[Request, Recorder | None, int | None]] = []
        pending = sorted(enumerate(w["reqs"]), key=lambda x: x[1][2])
        ids: dict[int, int] = {}
        step = 0
        while pending or not (sched.idle and sched._inflight is None):
            while pending and pending[0][1][2] <= step:
                i, (ids_, new, _, cancel) = pending.pop(0)
                r = request(ids_, new, seed=i)
                out = Recorder()
                try:
                    ids[i] = sched.submit(r, out)
                except RequestTooLong:
                    assert sched.refusal(r) is not None
                    fates.append((r, None, cancel))
                    continue
                fates.append((r, out, cancel))
            for i, (_, _, _, cancel) in enumerate(w["reqs"]):
                if cancel == step and i in ids:
                    sched.cancel(ids[i])
            step_checked(sched)
            step += 1
            assert step < 5000, "no progress"
        for r, out, cancel in fates:
            if out is None:
                continue
            if out.errors:
                assert cancel is not None and isinstance(out.errors[0], Cancelled), out.errors
                assert out.tokens == engine.reference(r)[: len(out.tokens)]
            else:
                assert out.tokens == engine.reference(r)
                assert out.admitted_n == 1
        check_released(sched)
        assert engine.compiles == sched.compiles_after_warmup
        event(f"preempted: {bool(sched.preemptions)}")
        event(f"prefix cache hit: {bool(sched.metrics.prefix_hits._value.get())}")
        event(f"cancelled: {any(out is not None and out.errors for _, out, _ in fates)}")
        event(f"refused: {any(out is None for _, out, _ in fates)}")
    finally:
        sched.stop()
        sched.run()
