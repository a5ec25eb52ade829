"""Slot groups: the decode states that hold the server's slots, and the threads that drive them.

The server's ``slots`` are split into equal **slot groups**. Each group is one batched
decode state of ``rows`` rows (``engine.init_decode_state(rows)``) and one thread from
which every engine call on that state is dispatched (``insert``, ``generate``, the empty
row that frees a slot). This module maps the server's slot numbers to (group, row), keeps
each group's state, and runs the warm-up calls for the shapes the scheduler names; it
decides nothing (which slot, when: the scheduler and :mod:`jaxlab.serve.policy` do) and
knows no requests.

Why one thread per group: XLA:CPU runs the computations that one thread dispatches in
dispatch order, and those of different threads side by side, so each group's calls go
through its own thread: in order within the group, concurrent across groups
(``docs/serving.md``). A call waits for the asynchronous dispatch only, not for the
computation. With one group this is a plain batched state on one thread.

A state passed to ``insert`` or ``generate`` is donated: while a call runs, and after
one raised, the group's ``state`` is None until :meth:`SlotGroup.reset`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jaxlab.infer.sampling import SamplingParams


class Engine(Protocol):
    """The engine's verbs and facts that serving uses: a
    :class:`jaxlab.infer.engine.Engine`, or the tests' fake (numpy, no compile)."""

    max_len: int
    buckets: tuple[int, ...]

    @property
    def compiles(self) -> dict[str, int]: ...

    def init_decode_state(self, slots: int) -> Any: ...

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        *,
        bucket: int | None = None,
    ) -> Any: ...

    def insert(self, prefix: Any, state: Any, slots: Sequence[int]) -> Any: ...

    def generate(self, state: Any, k: int) -> tuple[Any, Any, Any]: ...


class SlotGroup:
    """Slots ``start .. start + rows - 1``: one batched decode state and its thread."""

    def __init__(self, engine: Engine, index: int, rows: int) -> None:
        self.engine = engine
        self.index = index
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

    def reset(self) -> None:
        """A fresh state: every row empty (done)."""
        self.state = self.call(self.engine.init_decode_state, self.rows)

    def insert(self, prefix: Any, rows: Sequence[int]) -> None:
        """Row ``i`` of ``prefix`` into this group's row ``rows[i]`` (``-1``: skipped)."""
        state, self.state = self.state, None
        self.state = self.call(self.engine.insert, prefix, state, list(rows))

    def generate(self, k: int) -> tuple[Any, Any]:
        """Dispatch up to ``k`` decode steps; ``(tokens [k, rows], done [rows])`` on device."""
        state, self.state = self.state, None
        self.state, tokens, done = self.call(self.engine.generate, state, k)
        return tokens, done

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class SlotGroups(Sequence[SlotGroup]):
    """``slots`` slots as ``groups`` equal :class:`SlotGroup` (``groups`` divides ``slots``:
    ``serve.decode_groups`` is checked by the config, and
    :func:`~jaxlab.serve.policy.decode_groups_for` only picks divisors)."""

    def __init__(self, engine: Engine, slots: int, groups: int) -> None:
        self.engine = engine
        self.rows = slots // groups
        self._groups = [SlotGroup(engine, g, self.rows) for g in range(groups)]
        self._empty: Any = None

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, i: Any) -> Any:
        return self._groups[i]

    def __iter__(self) -> Iterator[SlotGroup]:
        return iter(self._groups)

    def group_of(self, slot: int) -> SlotGroup:
        return self._groups[slot // self.rows]

    def reset(self) -> None:
        """Fresh states for every group, and the empty row that frees a slot."""
        for g in self._groups:
            g.reset()
        self._empty = self.engine.init_decode_state(1)

    def insert(self, prefix: Any, slots: Sequence[int]) -> None:
        """Row ``i`` of ``prefix`` into slot ``slots[i]`` (``-1``: skipped): one insert per
        group that gets a row, with the group's own row numbers."""
        for g in self._groups:
            rows = [s - g.start if s in g else -1 for s in slots]
            if any(r >= 0 for r in rows):
                g.insert(prefix, rows)

    def free(self, slot: int) -> None:
        """Make ``slot`` empty on the device: an empty row (done, budget 0) inserted over it,
        after its group's chunk in flight, so the row stops computing at once and the decode
        loop's "every row done" exit still works."""
        g = self.group_of(slot)
        g.insert(self._empty, [slot - g.start])

    def generate(self, busy: Sequence[bool], k: int) -> list[tuple[SlotGroup, Any, Any]]:
        """Dispatch one chunk of ``k`` steps on every group with a busy slot (each from its
        own thread, so they run side by side); ``(group, tokens, done)`` per group."""
        ran = []
        for g in self._groups:
            if any(busy[s] for s in g.slots):
                tokens, done = g.generate(k)
                ran.append((g, tokens, done))
        return ran

    def warm_up(self, sizes: Sequence[int], k: int, pad: int) -> Iterator[None]:
        """Make every call serving will make, one compile per step (it yields before each):
        ``prefill`` per (bucket, admission group size in ``sizes``), ``insert`` per size,
        one ``generate`` of ``k`` steps, and a free. Every group has the same shapes, so
        the first group's calls compile for all. Prompts are the token ``pad``; the
        groups start afresh."""
        import jax

        from jaxlab.infer.sampling import SamplingParams

        eng = self.engine
        yield
        self.reset()
        first = self._groups[0]
        one = SamplingParams(max_new_tokens=1)
        for bucket in eng.buckets:
            for size in sizes:
                yield
                jax.block_until_ready(eng.prefill([[pad]] * size, [one] * size, bucket=bucket))
        for size in sizes:  # an insert that writes nothing: every row is skipped
            pre = eng.prefill([[pad]] * size, [one] * size)
            yield
            first.insert(pre.state, [-1] * size)
        yield
        # One real pass on slot 0: insert, a chunk, free.
        sp = SamplingParams(max_new_tokens=2 if eng.max_len >= 3 else 1, ignore_eos=True)
        first.insert(eng.prefill([[pad]], [sp]).state, [0])
        tokens, _ = first.generate(k)
        self.free(0)
        jax.block_until_ready((tokens, first.state))

    def close(self) -> None:
        for g in self._groups:
            g.close()


__all__ = ["Engine", "SlotGroup", "SlotGroups"]
