"""Scheduling decisions as pure functions: admission group sizes, slot choice, slot groups.

The scheduler (:mod:`jaxlab.serve.scheduler`) asks these what to do; they hold no state,
touch no device and start no thread, so each is tested on its own (with hypothesis).
The reasons behind each choice are explained, with measurements, in ``docs/serving.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def admission_sizes(prefill_batch: int) -> tuple[int, ...]:
    """Group sizes for prefilling admitted requests together, largest first: the powers
    of two below ``prefill_batch``, and ``prefill_batch`` itself (``8 -> (8, 4, 2, 1)``).

    Why not only ``prefill_batch`` and 1: in a closed loop requests mostly arrive a few at
    a time, and one prompt alone is the least efficient prefill per row. Every size is one
    more compiled prefill per bucket, so the sizes are few and fixed.
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
    a prefill call's cost grows much slower than its rows, and each call also costs the
    engine thread a host round trip.
    """
    largest = sizes[0]
    full, rest = divmod(n, largest)
    out = [largest] * full
    if rest:
        out.append(min(s for s in sizes if s >= rest))
    return out


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


__all__ = [
    "admission_sizes",
    "decode_groups_for",
    "pick_slots",
    "split_admission",
    "usable_cores",
]
