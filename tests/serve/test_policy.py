"""The scheduling decisions of :mod:`jaxlab.serve.policy`: pure functions, with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlab.config import ConfigError
from jaxlab.serve.policy import admission_sizes, decode_groups_for, pick_slots, split_admission


@pytest.mark.parametrize(
    ("prefill_batch", "sizes"),
    [(1, (1,)), (2, (2, 1)), (4, (4, 2, 1)), (6, (6, 4, 2, 1)), (8, (8, 4, 2, 1))],
)
def test_admission_sizes_are_powers_of_two_and_the_batch(prefill_batch, sizes):
    assert admission_sizes(prefill_batch) == sizes


@given(st.integers(1, 16), st.integers(0, 40))
def test_split_admission_takes_full_groups_then_pads_the_rest_into_one(batch, n):
    sizes = admission_sizes(batch)
    groups = split_admission(n, sizes)
    assert all(g in sizes for g in groups)
    assert groups == sorted(groups, reverse=True)
    # Every request has a row; the only padding is in the last group, and that group is
    # the smallest compiled size that holds what the full groups leave.
    full, rest = divmod(n, batch)
    assert groups[:full] == [batch] * full
    if rest:
        assert groups[full:] == [min(s for s in sizes if s >= rest)]
    else:
        assert groups[full:] == []
    assert sum(groups) >= n


@pytest.mark.parametrize(
    ("n", "groups"),
    [(0, []), (1, [1]), (3, [4]), (5, [8]), (8, [8]), (15, [8, 8]), (17, [8, 8, 1])],
)
def test_split_admission_examples(n, groups):
    assert split_admission(n, admission_sizes(8)) == groups


@given(st.integers(1, 64), st.integers(1, 16))
def test_auto_decode_groups_split_the_slots_evenly_one_per_core_at_most(slots, cores):
    groups = decode_groups_for(slots, 0, "cpu", cores=cores)
    assert slots % groups == 0 and 1 <= groups <= cores
    # The most groups that do: no larger divisor of slots fits under the core count.
    assert not any(slots % g == 0 for g in range(groups + 1, min(slots, cores) + 1))


@pytest.mark.parametrize(
    ("slots", "requested", "platform", "cores", "groups"),
    [
        (16, 0, "cpu", 2, 2),  # the bench-small server on a 2-core CPU: 2 groups of 8
        (16, 0, "cpu", 1, 1),
        (1, 0, "cpu", 2, 1),  # the 1-slot baseline has nothing to split
        (3, 0, "cpu", 2, 1),  # 3 slots do not split in two
        (12, 0, "cpu", 8, 6),
        (16, 0, "gpu", 8, 1),  # one device runs one program at a time: no groups
        (16, 0, "tpu", 8, 1),
        (16, 4, "cpu", 2, 4),  # an explicit value is taken as it is
        (16, 1, "cpu", 8, 1),
    ],
)
def test_decode_groups_examples(slots, requested, platform, cores, groups):
    assert decode_groups_for(slots, requested, platform, cores=cores) == groups


def test_decode_groups_must_divide_the_slots():
    """Checked once, where the value enters: the config (``decode_groups_for`` and the
    scheduler take a checked value)."""
    from jaxlab.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["serve.slots=16", "serve.decode_groups=3"], environ={})
    assert "serve.decode_groups: must divide serve.slots (got 3 and 16)" in str(e.value)
    assert "use a divisor of 16, or 0" in str(e.value)
    assert load_config("tiny", ["serve.slots=16", "serve.decode_groups=4"]).serve.decode_groups == 4


@st.composite
def slot_table(draw: st.DrawFn) -> tuple[list[bool], int, int]:
    rows = draw(st.integers(1, 8))
    busy = draw(
        st.lists(st.booleans(), min_size=rows, max_size=rows * 4).map(
            lambda b: b[: len(b) - len(b) % rows]
        )
    )
    n = draw(st.integers(0, busy.count(False)))
    return busy, rows, n


@given(slot_table())
def test_new_requests_take_the_least_busy_groups_lowest_free_slots(table):
    busy, rows, n = table
    picked = pick_slots(busy, rows, n)
    assert len(set(picked)) == n and not any(busy[s] for s in picked)
    after = list(busy)
    for s in picked:
        after[s] = True
    groups = [range(g, g + rows) for g in range(0, len(busy), rows)]
    load = [sum(after[s] for s in r) for r in groups]
    for g, r in enumerate(groups):
        mine = [s for s in picked if s in r]
        # Within a group, the lowest free slots, lowest first.
        assert mine == [s for s in r if not busy[s]][: len(mine)]
        # Balance: a group that got a request is at most one busier than any group that
        # still has a free slot (else that group would have taken it).
        if mine:
            for h, other in enumerate(groups):
                if not all(after[s] for s in other):
                    assert load[g] <= load[h] + 1, (busy, rows, picked)
    if len(groups) == 1:
        assert picked == [s for s in range(len(busy)) if not busy[s]][:n]


def test_pick_slots_examples():
    free = [False] * 4
    assert pick_slots(free, 2, 3) == [0, 2, 1]  # the scheduler test's three requests
    assert pick_slots([True, False, False, False], 2, 2) == [2, 1]
    assert pick_slots(free, 4, 4) == [0, 1, 2, 3]  # one group: lowest first
    with pytest.raises(ValueError, match="3 slots asked, 2 free"):
        pick_slots([True, False, True, False], 2, 3)
