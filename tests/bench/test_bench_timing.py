"""measure(): warm-up untimed, every repetition synced, raw samples kept, failures kept."""

from __future__ import annotations

from jaxlab.bench.timing import measure, no_sync


class FakeClock:
    def __init__(self, step: float = 0.5):
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_warmup_is_untimed_and_every_result_is_synced():
    calls: list[str] = []
    synced: list[int] = []

    def fn():
        calls.append("call")
        return len(calls)

    s = measure(fn, warmup=2, repeats=3, sync=synced.append, clock=FakeClock())
    assert len(calls) == 5
    assert synced == [1, 2, 3, 4, 5], "warm-up results are synced too"
    assert s.ok and s.error is None
    assert s.times_s == [0.5, 0.5, 0.5], "one raw sample per repetition, warm-up excluded"
    assert (s.warmup, s.repeats) == (2, 3)


def test_sync_happens_inside_the_timed_region():
    clock = FakeClock(step=1.0)
    seen: list[float] = []

    def sync(out):
        seen.append(clock.t)  # the clock has started but not stopped
        return out

    s = measure(lambda: None, warmup=0, repeats=2, sync=sync, clock=clock)
    assert seen == [1.0, 3.0]
    assert s.times_s == [1.0, 1.0]


def test_before_runs_ahead_of_every_call_outside_the_timed_region():
    clock = FakeClock(step=1.0)
    events: list[tuple[str, float]] = []

    def before():
        clock.t += 100.0  # a long wait that must not show in any sample
        events.append(("before", clock.t))

    def fn():
        events.append(("call", clock.t))

    s = measure(fn, warmup=1, repeats=2, sync=no_sync, clock=clock, before=before)
    assert [e for e, _ in events] == ["before", "call"] * 3, "warm-up included"
    assert s.times_s == [1.0, 1.0], "only the call is timed"


def test_exception_becomes_a_failure_with_partial_samples():
    n = {"calls": 0}

    def flaky():
        n["calls"] += 1
        if n["calls"] == 4:
            raise RuntimeError("device fell over")
        return n["calls"]

    s = measure(flaky, warmup=1, repeats=5, sync=no_sync, clock=FakeClock())
    assert not s.ok
    assert s.error is not None
    assert "RuntimeError: device fell over" in s.error
    assert "repetition 3 of 5" in s.error
    assert len(s.times_s) == 2, "samples taken before the failure are kept"


def test_failure_in_warmup_is_recorded():
    def broken():
        raise ValueError("bad shape")

    s = measure(broken, warmup=2, repeats=3, sync=no_sync)
    assert not s.ok and s.times_s == []
    assert s.error is not None and "warm-up call 1 of 2" in s.error


def test_real_jax_block_until_ready_default():
    import jax.numpy as jnp

    x = jnp.ones((8, 8))
    s = measure(lambda: x @ x, warmup=1, repeats=3)
    assert s.ok and len(s.times_s) == 3 and all(t > 0 for t in s.times_s)


def test_warm_each_runs_untimed_right_before_each_timed_call():
    clock = FakeClock(step=1.0)
    events: list[str] = []

    def fn():
        events.append("call")

    s = measure(
        fn,
        warmup=1,
        repeats=2,
        sync=no_sync,
        clock=clock,
        before=lambda: events.append("before"),
        warm_each=2,
    )
    assert events == ["before", "call"] + ["before", "call", "call", "call"] * 2
    assert s.times_s == [1.0, 1.0], "the warming calls are not timed"


def test_negative_warm_each_is_refused():
    import pytest

    with pytest.raises(ValueError, match="warm_each >= 0"):
        measure(lambda: None, warmup=0, repeats=1, sync=no_sync, warm_each=-1)
