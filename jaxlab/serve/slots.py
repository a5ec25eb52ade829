"""Slot groups: the decode states that hold the server's slots, their KV pages, and the
threads that drive them.

The server's ``slots`` are split into equal **slot groups**. Each group is one batched
decode state of ``rows`` rows over a paged KV pool of its own
(``engine.init_decode_state(rows, num_pages)``), the :class:`~jaxlab.infer.pages.PagePool`
that lends those pages to its requests, the host copy of its page table
(:class:`PageTable`, sent with ``engine.set_table`` before a chunk whenever it changed),
and one thread from which every engine call on that state is dispatched (``prefill``,
``insert``, ``set_table``, ``generate``, the empty row that frees a slot). This module maps
the server's slot numbers to (group, row), keeps each group's state, pool and table, and
runs the warm-up calls for the shapes the scheduler names; it decides nothing (which slot,
which pages, when: the scheduler and :mod:`jaxlab.serve.policy` do) and knows no requests.

Why one thread per group: XLA:CPU runs the computations that one thread dispatches in
dispatch order, and those of different threads side by side, so each group's calls go
through its own thread: in order within the group, concurrent across groups
(``docs/serving.md``). A call waits for the asynchronous dispatch only, not for the
computation. With one group this is a plain batched state on one thread. The order within
a group is also what makes page reuse safe: a page released while a chunk in flight still
writes it is only written by its next owner's prefill, dispatched after that chunk.

A state passed to an engine call is donated: while a call runs, and after one raised
having consumed it, the group's ``state`` is None until :meth:`SlotGroup.reset`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from jaxlab.infer.chunks import Chunk
    from jaxlab.infer.pages import PagePool

#: Token of the warm-up's prompts and of the empty row (any valid id).
PAD_TOKEN = 0


class Engine(Protocol):
    """The engine's verbs and facts that serving uses: a
    :class:`jaxlab.infer.engine.Engine`, or the tests' fake (numpy, no compile)."""

    @property
    def max_len(self) -> int: ...

    @property
    def page_size(self) -> int: ...

    @property
    def buckets(self) -> tuple[int, ...]: ...

    @property
    def compiles(self) -> dict[str, int]: ...

    @property
    def stage_lengths(self) -> tuple[int, ...]:
        """The lengths a ``generate`` may stage of each row, one executable each
        (:mod:`jaxlab.kernels.staged`)."""
        ...

    def pool_pages(self, slots: int, groups: int = 1) -> int: ...

    def init_decode_state(self, slots: int, num_pages: int | None = None) -> Any: ...

    def set_table(self, state: Any, table: np.ndarray) -> Any: ...

    def prefill(self, state: Any, chunks: Sequence[Chunk]) -> tuple[Any, Any]: ...

    def insert(self, prefix: Any, state: Any, slots: Sequence[int]) -> Any: ...

    def generate(self, state: Any, k: int, /) -> tuple[Any, ...]:
        """``(state, tokens, done)``, and a speculating engine's per-row ``stats``."""
        ...


def survived(state: Any) -> bool:
    """Whether a state handed to a call that raised is still whole (the call failed before
    it consumed it: a donated jax array, or the fake's state, says it is deleted)."""
    import jax

    return state is not None and not any(
        getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(state)
    )


class PageTable:
    """The host copy of one group's page table: ``int32[rows, max_pages]``, ``no_page``
    where a row holds no page. ``dirty`` until :meth:`take` hands it to ``set_table``."""

    def __init__(self, rows: int, max_pages: int, no_page: int) -> None:
        self.no_page = no_page
        self.array = np.full((rows, max_pages), no_page, np.int32)
        self.dirty = True

    def set(self, row: int, pages: Sequence[int]) -> None:
        """Row ``row`` holds ``pages`` (its pages in position order)."""
        n = len(pages)
        if (
            np.array_equal(self.array[row, :n], pages)
            and (self.array[row, n:] == self.no_page).all()
        ):
            return
        self.array[row] = self.no_page
        self.array[row, :n] = pages
        self.dirty = True

    def clear(self, row: int) -> None:
        if self.array[row, 0] != self.no_page:
            self.array[row] = self.no_page
            self.dirty = True

    def take(self) -> np.ndarray:
        self.dirty = False
        return self.array.copy()


class SlotGroup:
    """Slots ``start .. start + rows - 1``: one batched decode state over ``num_pages``
    pages, its page pool and table, and its thread."""

    def __init__(
        self, engine: Engine, index: int, rows: int, num_pages: int, prefix_caching: bool
    ) -> None:
        self.engine = engine
        self.index = index
        self.start = index * rows
        self.rows = rows
        self.num_pages = num_pages
        self.prefix_caching = prefix_caching
        self.max_pages = -(-engine.max_len // engine.page_size)
        self.state: Any = None
        self.pool: PagePool = self._pool()
        self.table = PageTable(rows, self.max_pages, num_pages)
        self._empty: Any = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"jaxlab-decode-{index}")

    def _pool(self) -> PagePool:
        from jaxlab.infer.pages import PagePool

        return PagePool(self.num_pages, self.engine.page_size, prefix_caching=self.prefix_caching)

    @property
    def slots(self) -> range:
        return range(self.start, self.start + self.rows)

    @property
    def no_page(self) -> int:
        return self.num_pages

    def __contains__(self, slot: int) -> bool:
        return self.start <= slot < self.start + self.rows

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` dispatched from this group's thread."""
        return self._thread.submit(fn, *args).result()

    def reset(self) -> None:
        """A fresh state (every row empty, every table entry ``NO_PAGE``), an empty pool and
        table (the old pages' contents, the prefix cache included, went with the old
        state), and the empty row that frees a slot: a one-token prompt with a one-token
        budget, done as soon as it is prefilled (into a page lent for that call only)."""
        from jaxlab.infer.chunks import Chunk
        from jaxlab.infer.sampling import SamplingParams

        self.state = None
        self.pool = self._pool()
        self.table = PageTable(self.rows, self.max_pages, self.num_pages)
        self.state = self.call(self.engine.init_decode_state, self.rows, self.num_pages)
        pages = self.lend("empty row", 1)
        one = SamplingParams(max_new_tokens=1)
        self._empty = self.prefill([Chunk((PAD_TOKEN,), 0, pages, one)])
        self.pool.release("empty row")

    def lend(self, name: str, n_tokens: int) -> list[int]:
        """Pages for ``n_tokens`` tokens under ``name`` (the group's own calls: the empty
        row, the warm-up); :meth:`PagePool.release` gives them back."""
        admission = self.pool.admit(name, (PAD_TOKEN,) * n_tokens)
        if admission is None:
            raise ValueError(f"slot group {self.index}: no page free for {name}")
        return admission.pages

    def prefill(self, chunks: Sequence[Chunk]) -> Any:
        """Prefill ``chunks`` (their K/V into this group's pages); the engine's ``Prefill``.
        If the call raises before it consumed the state, the state is kept."""
        state, self.state = self.state, None
        try:
            self.state, pre = self.call(self.engine.prefill, state, list(chunks))
        except Exception:
            if survived(state):
                self.state = state
            raise
        return pre

    def insert(self, pre: Any, rows: Sequence[int]) -> None:
        """Row ``i`` of ``pre`` into this group's row ``rows[i]`` (``-1``: skipped). The
        insert also copies the chunks' page lists into the device's table, so the host's
        table is sent again before the next chunk, whatever it holds."""
        state, self.state = self.state, None
        self.state = self.call(self.engine.insert, pre, state, list(rows))
        self.table.dirty = True

    def free(self, row: int) -> None:
        """Make ``row`` empty on the device: an empty row (done) inserted over it, after the
        group's chunk in flight, so the row stops computing at once and the decode loop's
        "every row done" exit still works."""
        self.insert(self._empty, [row])

    def generate(self, k: int) -> tuple[Any, Any, Any]:
        """Send the page table if it changed, then dispatch up to ``k`` decode steps;
        ``(tokens [k, rows], done [rows], stats)`` on device (``stats``: a speculating
        engine's per-row drafted and accepted tokens, or None)."""
        state, self.state = self.state, None
        if self.table.dirty:
            state = self.call(self.engine.set_table, state, self.table.take())
        self.state, tokens, done, *stats = self.call(self.engine.generate, state, k)
        return tokens, done, (stats[0] if stats else None)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class SlotGroups(Sequence[SlotGroup]):
    """``slots`` slots as ``groups`` equal :class:`SlotGroup` of ``num_pages`` pages each
    (``groups`` divides ``slots``: ``serve.decode_groups`` is checked by the config, and
    :func:`~jaxlab.serve.policy.decode_groups_for` only picks divisors)."""

    def __init__(
        self, engine: Engine, slots: int, groups: int, num_pages: int, prefix_caching: bool
    ) -> None:
        self.engine = engine
        self.rows = slots // groups
        self._groups = [
            SlotGroup(engine, g, self.rows, num_pages, prefix_caching) for g in range(groups)
        ]

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, i: Any) -> Any:
        return self._groups[i]

    def __iter__(self) -> Iterator[SlotGroup]:
        return iter(self._groups)

    def group_of(self, slot: int) -> SlotGroup:
        return self._groups[slot // self.rows]

    def reset(self) -> None:
        for g in self._groups:
            g.reset()

    @property
    def pages_used(self) -> int:
        return sum(g.pool.used for g in self._groups)

    @property
    def pages_total(self) -> int:
        return sum(g.num_pages for g in self._groups)

    def generate(self, busy: Sequence[bool], k: int) -> list[tuple[SlotGroup, Any, Any, Any]]:
        """Dispatch one chunk of ``k`` steps on every group with a busy slot (each from its
        own thread, so they run side by side); ``(group, tokens, done, stats)`` per group."""
        ran = []
        for g in self._groups:
            if any(busy[s] for s in g.slots):
                ran.append((g, *g.generate(k)))
        return ran

    def warm_up(
        self, sizes: Sequence[int], lengths: Sequence[int], extend: bool, k: int
    ) -> Iterator[None]:
        """Make every call serving will make, one compile per step (it yields before each):
        ``prefill`` per (chunk length in ``lengths``, row count in ``sizes``), for chunks at
        the start of a prompt and, with ``extend``, for chunks past it (a prompt's later
        chunks, or the rest after a prefix-cache hit); ``insert`` per row count; one real
        pass (``set_table``, a ``generate`` of ``k`` steps, a free). Every group has the
        same shapes, so the first group's calls compile for all; then a ``generate`` per
        staged length (``engine.stage_lengths``: a chunk stages as much of each row as
        the table spans), every row done. The groups start afresh, and end with every page
        back in their pools.

        The shape calls write into two pages lent for the warm-up: ``prefix`` holds
        position 0, which the chunks past the start attend to, and ``scratch`` every other
        position of every chunk (the same page over and over: what they write is never
        read), so a pool of two pages warms every length.
        """
        import jax

        from jaxlab.infer.chunks import Chunk
        from jaxlab.infer.sampling import SamplingParams

        eng = self.engine
        yield
        self.reset()
        first = self._groups[0]
        ps = eng.page_size
        one = SamplingParams(max_new_tokens=1)
        prefix = first.lend("warm-up prefix", 1)[0]
        scratch = first.lend("warm-up scratch", 1)[0] if first.pool.free else prefix

        def chunks(n: int, length: int, start: int) -> list[Chunk]:
            pages = [prefix if start else scratch] + [scratch] * ((start + length - 1) // ps)
            return [Chunk((PAD_TOKEN,) * length, start, pages, one, last=False)] * n

        first.prefill([Chunk((PAD_TOKEN,), 0, [prefix], one, last=False)])  # its position 0
        for start in [0, 1] if extend else [0]:
            for length in lengths:
                length = min(length, eng.max_len - start)
                for size in sizes:
                    yield
                    jax.block_until_ready(first.prefill(chunks(size, length, start)))
        for size in sizes:  # an insert that writes nothing: every row is skipped
            pre = first.prefill(chunks(size, 1, 0))
            yield
            first.insert(pre, [-1] * size)
        first.pool.release("warm-up prefix")
        first.pool.release("warm-up scratch")
        yield
        # One real pass on row 0 over pages of its own: prefill, insert, a chunk, free.
        sp = SamplingParams(max_new_tokens=2 if eng.max_len >= 3 else 1, ignore_eos=True)
        pages = first.lend("warm-up", 2)
        pre = first.prefill([Chunk((PAD_TOKEN,), 0, pages, sp)])
        first.insert(pre, [0])
        first.table.set(0, pages)
        tokens, _, _ = first.generate(k)
        first.free(0)
        # Row 0, done, names the lent pages up to each staged length: every row is done,
        # so each chunk compiles and returns at once.
        for length in eng.stage_lengths:
            yield
            first.table.set(0, [pages[0]] * -(-length // ps))
            tokens, _, _ = first.generate(k)
        first.pool.release("warm-up")
        first.table.clear(0)
        jax.block_until_ready((tokens, first.state))

    def close(self) -> None:
        for g in self._groups:
            g.close()


__all__ = ["PAD_TOKEN", "Engine", "PageTable", "SlotGroup", "SlotGroups", "survived"]
