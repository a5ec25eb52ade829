"""Scheduling decisions as pure functions: admission group sizes, slot choice, slot groups,
the paged KV cache's split over the groups, prefill chunks, page growth and preemption.

The scheduler (:mod:`jaxlab.serve.scheduler`) asks these what to do; they hold no state,
touch no device and start no thread, so each is tested on its own (with hypothesis).
The reasons behind each choice are explained, with measurements, in ``docs/serving.md``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def admission_sizes(prefill_batch: int) -> tuple[int, ...]:
    """Row counts of the prefill calls the warm-up makes, largest first: the powers of two
    below ``prefill_batch``, and ``prefill_batch`` itself (``8 -> (8, 4, 2, 1)``). The
    engine pads a call's rows to a power of two, so these reach every row bucket a call of
    at most ``prefill_batch`` chunks can use, and nothing else: every bucket is one more
    compiled prefill per length bucket.
    """
    sizes = {prefill_batch}
    n = 1
    while n < prefill_batch:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes, reverse=True))


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the OS has one."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decode_groups_for(slots: int, requested: int, platform: str, cores: int | None = None) -> int:
    """How many slot groups to decode concurrently (``serve.decode_groups`` resolved).

    ``requested > 0`` is taken as it is (the config checks that it divides ``slots``).
    ``0`` (auto) on the CPU backend is the most groups, at most ``cores`` (default
    :func:`usable_cores`), that split the slots evenly: 16 slots on 2 cores -> 2 groups
    of 8. Why: XLA:CPU runs one small decode step on about one core, and executions
    dispatched from two threads run side by side. Elsewhere (GPU, TPU) one device runs
    one program at a time, so auto is 1.
    """
    if requested:
        return requested
    if platform != "cpu":
        return 1
    cap = max(1, min(slots, usable_cores() if cores is None else cores))
    return max(g for g in range(1, cap + 1) if slots % g == 0)


def slot_candidates(busy: Sequence[bool], group_rows: int) -> list[int]:
    """Where a new request may go, best first: the lowest free slot of each slot group that
    has one, the group with the fewest busy slots first (ties: the lowest group).

    Why this order: requests spread over the groups, so the groups' chunks share the work,
    and pack low within a group, as a decode step computes a group's rows only up to its
    last busy one. A request takes the first candidate whose group's page pool admits it
    (each group has a pool of its own), so the others are the fallbacks.
    """
    groups = [range(g, min(g + group_rows, len(busy))) for g in range(0, len(busy), group_rows)]
    order = sorted(range(len(groups)), key=lambda i: (sum(busy[s] for s in groups[i]), i))
    return [
        next(s for s in groups[i] if not busy[s])
        for i in order
        if not all(busy[s] for s in groups[i])
    ]


def pick_slots(busy: Sequence[bool], group_rows: int, n: int) -> list[int]:
    """``n`` free slots (``busy[s]`` false) for new requests, in the order they are taken:
    each the first of :func:`slot_candidates`, counting the ones taken before it. With one
    group: the ``n`` lowest free slots. Raises ``ValueError`` if fewer than ``n`` are free.
    """
    taken = list(busy)
    out: list[int] = []
    for _ in range(n):
        candidates = slot_candidates(taken, group_rows)
        if not candidates:
            raise ValueError(f"{n} slots asked, {busy.count(False)} free")
        taken[candidates[0]] = True
        out.append(candidates[0])
    return out


# ----------------------------------------------------------------------------- the paged cache


def pages_per_group(total_pages: int, groups: int) -> int:
    """Each slot group's pool: the server's ``total_pages`` split evenly (the remainder of
    the division is left unused). Raises ``ValueError`` when a group would get none."""
    if total_pages < groups:
        raise ValueError(
            f"a KV pool of {total_pages} pages cannot be split over {groups} slot groups"
            " (each needs at least one page): raise inference.num_pages or"
            " inference.kv_cache_mib, or lower serve.decode_groups"
        )
    return total_pages // groups


def kv_tokens(prompt_tokens: int, max_new_tokens: int) -> int:
    """The most positions of K/V one request ever holds: its prompt and every generated
    token but the last (a token's K/V is written when it is fed back, and the last one
    never is)."""
    return prompt_tokens + max_new_tokens - 1


def never_fits(prompt_tokens: int, max_new_tokens: int, page_size: int, group_pages: int) -> bool:
    """True when a request cannot run even alone in a slot group's pool: its prompt plus
    ``max_new_tokens`` take more pages than the pool has. (The same sum as the
    ``inference.max_len`` check of ``Request.create``, so the two limits read alike; it
    counts one position more than :func:`kv_tokens`, which growth uses.)"""
    return -(-(prompt_tokens + max_new_tokens) // page_size) > group_pages


def grow_target(position: int, chunk_tokens: int, chunks_ahead: int, cap: int) -> int:
    """Tokens a decoding row's pages must cover before the next ``generate``: its device
    position (that of its last sampled token, not yet written), plus ``chunk_tokens`` for
    the chunk about to run and for each of its ``chunks_ahead`` chunks dispatched but not
    yet read back, at most ``cap`` (:func:`kv_tokens`)."""
    return min(cap, position + chunk_tokens * (1 + chunks_ahead))


def plan_chunks(
    waiting: Sequence[tuple[int, int]],
    budget: int | None,
    max_rows: int,
    spent: Mapping[int, int] | None = None,
) -> list[int]:
    """Prompt tokens to prefill this round for each sequence being prefilled (0: none).

    ``waiting`` holds ``(slot group, tokens left)`` per sequence, oldest first; ``budget``
    is each slot group's token limit for the round (None: none, whole prompts) and
    ``max_rows`` the most sequences one group prefills in one call; ``spent``, the tokens
    each group already prefilled this round (earlier calls of the same step). Oldest first, each gets
    what it has left while its group's budget lasts; the first that does not fit gets the
    rest of that budget (its prompt continues next step). So one long prompt cannot hold
    back its group's decode chunk for longer than ``budget`` tokens of prefill, and short
    prompts are packed together.

    The budget is per group because a group's decode waits only for its own group's
    prefill: the groups' prefill calls are dispatched side by side, each on its group's
    thread (:meth:`Scheduler._run_chunks`). One budget shared by the groups would admit a
    busy server's prompts at one group's rate.
    """
    out: list[int] = []
    rows: dict[int, int] = {}
    room: dict[int, int] = {}
    spent = spent or {}
    for group, left in waiting:
        if budget is not None and group not in room:
            room[group] = max(budget - spent.get(group, 0), 0)
        take = left if budget is None else min(left, room[group])
        if take <= 0 or rows.get(group, 0) >= max_rows:
            out.append(0)
            continue
        rows[group] = rows.get(group, 0) + 1
        out.append(take)
        if budget is not None:
            room[group] -= take
    return out


def warm_chunk_lengths(buckets: Sequence[int], chunk_tokens: int, max_len: int) -> list[int]:
    """One chunk length per prefill length bucket that serving can use (the warm-up
    prefills each): every bucket below the chunk limit (``chunk_tokens``, 0 = whole
    prompts, i.e. ``max_len``), and the limit itself, whose bucket holds every longer
    chunk."""
    limit = min(chunk_tokens or max_len, max_len)
    return [b for b in sorted(set(buckets)) if b < limit] + [limit]


__all__ = [
    "admission_sizes",
    "decode_groups_for",
    "grow_target",
    "kv_tokens",
    "never_fits",
    "pages_per_group",
    "pick_slots",
    "plan_chunks",
    "slot_candidates",
    "usable_cores",
    "warm_chunk_lengths",
]
