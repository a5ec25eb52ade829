"""The scheduling decisions of :mod:`jaxlab.serve.policy`: pure functions, with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlab.config import ConfigError
from jaxlab.serve.policy import (
    admission_sizes,
    decode_groups_for,
    grow_target,
    kv_tokens,
    never_fits,
    pages_per_group,
    pick_slots,
    plan_chunks,
    slot_candidates,
    warm_chunk_lengths,
)


@pytest.mark.parametrize(
    ("prefill_batch", "sizes"),
    [(1, (1,)), (2, (2, 1)), (4, (4, 2, 1)), (6, (6, 4, 2, 1)), (8, (8, 4, 2, 1))],
)
def test_admission_sizes_are_powers_of_two_and_the_batch(prefill_batch, sizes):
    assert admission_sizes(prefill_batch) == sizes


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


def test_slot_candidates_one_per_open_group_least_busy_first():
    assert slot_candidates([False] * 4, 2) == [0, 2]
    assert slot_candidates([True, False, False, False], 2) == [2, 1]
    assert slot_candidates([True, True, True, False], 2) == [3]
    assert slot_candidates([True] * 4, 2) == []
    assert slot_candidates([True, False, False, True, False, False], 3) == [1, 4]


# ----------------------------------------------------------------------------- the paged cache


def test_pages_per_group_splits_evenly_and_refuses_an_empty_group():
    assert pages_per_group(64, 2) == 32
    assert pages_per_group(65, 2) == 32  # the odd page is left unused
    with pytest.raises(ValueError, match="3 pages cannot be split over 4 slot groups"):
        pages_per_group(3, 4)


def test_a_request_holds_its_prompt_and_all_but_its_last_token():
    assert kv_tokens(10, 1) == 10  # one token: its K/V is never written
    assert kv_tokens(10, 6) == 15
    # never_fits counts prompt + max_new_tokens, as the max_len check does
    assert not never_fits(10, 6, page_size=4, group_pages=4)
    assert never_fits(10, 7, page_size=4, group_pages=4)


@pytest.mark.parametrize(
    ("position", "k", "ahead", "cap", "target"),
    [(9, 4, 0, 100, 13), (9, 4, 1, 100, 17), (9, 4, 1, 15, 15), (0, 8, 0, 3, 3)],
)
def test_grow_target_covers_the_coming_chunk_and_those_in_flight(position, k, ahead, cap, target):
    assert grow_target(position, k, ahead, cap) == target


@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50)), max_size=12),
    st.one_of(st.none(), st.integers(1, 64)),
    st.integers(1, 4),
    st.dictionaries(st.integers(0, 2), st.integers(0, 80), max_size=3),
)
def test_plan_chunks_keeps_each_groups_budget_the_row_cap_and_the_order(
    waiting, budget, max_rows, spent
):
    plan = plan_chunks(waiting, budget, max_rows, spent)
    assert len(plan) == len(waiting)
    assert all(0 <= n <= left for n, (_, left) in zip(plan, waiting, strict=True))
    for g in {g for g, _ in waiting}:
        mine = [n for n, (h, _) in zip(plan, waiting, strict=True) if h == g]
        if budget is not None:
            assert sum(mine) <= max(budget - spent.get(g, 0), 0)
        assert sum(1 for n in mine if n) <= max_rows
    # Oldest first within a group: a request gets less than it has left only when its
    # group's budget ran out or its group's call is full; and then every later one of that
    # group gets nothing. Groups do not take from each other's budgets.
    used: dict[int, int] = {}
    rows: dict[int, int] = {}
    for n, (g, left) in zip(plan, waiting, strict=True):
        room = None if budget is None else max(budget - spent.get(g, 0) - used.get(g, 0), 0)
        if rows.get(g, 0) >= max_rows:
            assert n == 0
        else:
            assert n == (left if room is None else min(left, room))
        if n:
            rows[g] = rows.get(g, 0) + 1
        used[g] = used.get(g, 0) + n


def test_plan_chunks_examples():
    assert plan_chunks([(0, 40), (0, 3)], 8, 4) == [8, 0]  # the long one first, cut
    assert plan_chunks([(0, 3), (0, 3), (0, 40)], 16, 4) == [3, 3, 10]
    assert plan_chunks([(0, 3), (0, 3), (1, 3)], None, 1) == [3, 0, 3]  # one row per group
    # Each group has its own budget: group 1 is not starved by group 0's long prompt.
    assert plan_chunks([(0, 40), (1, 40)], 16, 4) == [16, 16]
    assert plan_chunks([(0, 40), (1, 40)], 16, 4, {0: 10, 1: 16}) == [6, 0]


@pytest.mark.parametrize(
    ("buckets", "chunk", "max_len", "lengths"),
    [
        ((16, 64), 0, 64, [16, 64]),  # whole prompts: every bucket
        ((16, 32, 64, 128), 64, 128, [16, 32, 64]),
        ((16, 32, 64, 128), 40, 128, [16, 32, 40]),  # 40 pads to 64: its bucket is warmed
        ((16, 64), 8, 64, [8]),
        ((16, 64), 100, 64, [16, 64]),
    ],
)
def test_warm_chunk_lengths_reach_every_bucket_a_chunk_can_use(buckets, chunk, max_len, lengths):
    assert warm_chunk_lengths(buckets, chunk, max_len) == lengths
