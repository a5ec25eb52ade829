"""A fake paged engine for the scheduler's tests: the engine's device verbs over numpy, no jax.

:class:`FakeEngine` answers ``init_decode_state``, ``set_table``, ``prefill`` (chunks),
``insert`` and ``generate`` as the paged :class:`jaxlab.infer.engine.Engine` does: the same
shapes, the same ``done``/budget/stop-token rules, ``-1`` for "no token", donated states,
K/V written into pages through each chunk's page list and each decode row's page-table row.

Its "K/V" is a hash chain: the cell of position ``p`` holds ``chain(cell p-1, token p)``,
so a cell's value depends on every token before it, as real K/V does, and a token is
sampled from the cell of the position before it (:func:`next_token`), read back through
the pages. Hence:

- a row's tokens are a deterministic function of its prompt, seed and index, whatever its
  batch, slot, pages, or how its prompt was split into chunks or served from the prefix
  cache (:meth:`FakeEngine.reference` says what it must get);
- recomputing a preempted request (prompt + generated tokens, ``generated`` offset) yields
  the same continuation only if exactly the right tokens were fed back;
- every read checks each cell it passes (written for that position, consistent with the
  cell before it): a page read that another sequence overwrote, a read through ``NO_PAGE``
  and a live row's write through ``NO_PAGE`` (a page the host forgot to grow) raise
  :class:`PageFault` and are recorded in ``faults``. A write through a page already given
  to someone else shows up as the owner's next read failing.

Tokens are lower-case ASCII letters (ids 97-122), so the byte tokenizer turns them into
text. For the tests it also records every call (``calls``), counts "compiles" (distinct
shapes per verb, as ``ShapeKeyedJit`` does), refuses a donated state, and fails or waits on
demand (:meth:`fail_next`, :meth:`fail_prompt`, ``gate``).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from jaxlab.infer.request import Limits, Request
from jaxlab.infer.sampling import MAX_STOP_TOKENS

if TYPE_CHECKING:
    from jaxlab.infer.chunks import Chunk

NO_TOKEN = -1
_MASK = (1 << 62) - 1


def chain(previous: int, token: int) -> int:
    """The fake K/V of ``token`` after a prefix whose last cell holds ``previous``."""
    x = (int(previous) * 0x9E3779B97F4A7C15 + int(token) + 1) & _MASK
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    return x ^ (x >> 32)


def next_token(kv: int, seed: int, t: int) -> int:
    """The ``t``-th sampled token of a row whose last cell holds ``kv``."""
    return 97 + zlib.crc32(struct.pack("<qqq", kv, seed, t)) % 26


class PageFault(AssertionError):
    """A read of a page the sequence does not own, or a write the pool did not make room for."""


@dataclass
class Rows:
    """Per-row fields of a decode state (or of a prefill's rows)."""

    seed: np.ndarray  # i32[B]
    pos: np.ndarray  # i32[B]: the next position written (that of ``tokens``)
    generated: np.ndarray  # i32[B]
    done: np.ndarray  # bool[B]
    max_new: np.ndarray  # i32[B]
    stop: np.ndarray  # i32[B, MAX_STOP_TOKENS], -1 = unused
    tokens: np.ndarray  # i32[B]: each row's last token, not yet written
    table: np.ndarray  # i32[B, max_pages]: a prefill row's chunk pages (insert copies them)

    @classmethod
    def empty(cls, n: int, max_pages: int, no_page: int) -> Rows:
        z = np.zeros(n, np.int32)
        return cls(
            z.copy(),
            z.copy(),
            z.copy(),
            np.ones(n, np.bool_),
            z.copy(),
            np.full((n, MAX_STOP_TOKENS), -1, np.int32),
            z.copy(),
            np.full((n, max_pages), no_page, np.int32),
        )

    def copy(self) -> Rows:
        return Rows(**{f.name: getattr(self, f.name).copy() for f in dataclasses.fields(self)})

    def put(self, row: int, other: Rows, other_row: int) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name)[row] = getattr(other, f.name)[other_row]


@dataclass
class FakeState:
    """A paged decode state: the pool's cells, the page table and the rows."""

    kv: np.ndarray  # i64[num_pages, page_size]: chain value of each cell
    tok: np.ndarray  # i64[num_pages, page_size]: the token written there
    where: np.ndarray  # i32[num_pages, page_size]: the position written there (-1: never)
    table: np.ndarray  # i32[slots, max_pages], NO_PAGE = num_pages
    rows: Rows
    donated: bool = False

    @property
    def slots(self) -> int:
        return len(self.rows.done)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    @property
    def done(self) -> np.ndarray:
        return self.rows.done

    def is_deleted(self) -> bool:  # as a donated jax array answers
        return self.donated

    def copy(self) -> FakeState:
        return FakeState(
            self.kv.copy(), self.tok.copy(), self.where.copy(), self.table.copy(), self.rows.copy()
        )


class Prefill(NamedTuple):
    """As the engine's: rows padded to a power of two; ``last`` per chunk."""

    state: Rows
    tokens: np.ndarray
    done: np.ndarray
    bucket: int | None
    last: tuple[bool, ...] = ()


def row_bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class FakeEngine:
    platform = "cpu"
    precision = "float32"
    compile_cache_hits = 0

    def __init__(
        self,
        *,
        vocab_size: int = 258,
        max_len: int = 64,
        buckets: Sequence[int] = (16, 64),
        page_size: int = 4,
        num_pages: int | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.num_pages = num_pages  # the configured pool (inference.num_pages); None: default
        self.max_len = max_len
        self.buckets = tuple(buckets)
        self.page_size = page_size
        self.max_pages = math.ceil(max_len / page_size)
        self.calls: list[tuple[Any, ...]] = []
        self.shapes: dict[str, set[tuple[Any, ...]]] = {"prefill": set(), "insert": set()}
        self.shapes["generate"] = set()
        self.faults: list[str] = []
        #: While cleared, ``generate`` waits for it (a slow device).
        self.gate = threading.Event()
        self.gate.set()
        self._fail: dict[str, Exception] = {}
        self._poison: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ facts

    @property
    def compiles(self) -> dict[str, int]:
        return {verb: len(shapes) for verb, shapes in self.shapes.items() if shapes}

    @property
    def stage_lengths(self) -> tuple[int, ...]:
        return (self.max_len,)  # nothing staged: one decode shape

    def limits(self, eos_id: int | None = None) -> Limits:
        return Limits(self.vocab_size, self.max_len, eos_id)

    def pool_pages(self, slots: int, groups: int = 1) -> int:
        if self.num_pages is None:
            return slots * self.max_pages
        return self.num_pages // groups

    def bucket_for(self, n_tokens: int) -> int:
        return next(b for b in self.buckets if b >= n_tokens)

    def fail_next(self, verb: str, error: Exception | None = None) -> None:
        """Make the next call of ``verb`` raise (before it touches the state)."""
        self._fail[verb] = error or RuntimeError(f"{verb} broke")

    def fail_prompt(self, prompt: Sequence[int]) -> None:
        """Make every prefill with a chunk of ``prompt`` raise (alone or in a batch),
        before it touches the state."""
        self._poison.add(tuple(prompt))

    def reference(self, request: Request) -> list[int]:
        """Every token ``request`` gets alone, its stop token included."""
        kv = 0
        for t in request.prompt_ids:
            kv = chain(kv, t)
        out: list[int] = []
        for t in range(request.sampling.max_new_tokens):
            out.append(next_token(kv, request.sampling.seed, t))
            if out[-1] in request.stop_ids:
                break
            kv = chain(kv, out[-1])
        return out

    def _called(self, verb: str, shape: tuple[Any, ...] | None, *details: Any) -> None:
        with self._lock:
            if shape is not None:
                self.shapes[verb].add(shape)
            self.calls.append((verb, *details))
            error = self._fail.pop(verb, None)
        if error is not None:
            raise error

    def _fault(self, what: str) -> PageFault:
        self.faults.append(what)
        return PageFault(what)

    @staticmethod
    def _take(state: FakeState) -> FakeState:
        if state.donated:
            raise RuntimeError("a donated state was used again")
        state.donated = True
        return state.copy()

    # ------------------------------------------------------------------ pages

    def _read(self, st: FakeState, pages: Sequence[int], n: int, who: str) -> int:
        """Check the cells of positions ``0 .. n-1`` through ``pages``; the last one's value."""
        ps, previous = self.page_size, 0
        for p in range(n):
            page = pages[p // ps] if p // ps < len(pages) else st.num_pages
            if page >= st.num_pages:
                raise self._fault(f"{who} read position {p} through NO_PAGE")
            off = p % ps
            if st.where[page, off] != p or st.kv[page, off] != chain(previous, st.tok[page, off]):
                raise self._fault(
                    f"{who} read position {p} from page {page}, which holds another's"
                )
            previous = int(st.kv[page, off])
        return previous

    def _write(self, st: FakeState, pages: Sequence[int], p: int, kv: int, token: int) -> bool:
        """Write position ``p``; False if its page is ``NO_PAGE`` (the write is dropped)."""
        page = pages[p // self.page_size] if p // self.page_size < len(pages) else st.num_pages
        if page >= st.num_pages:
            return False
        off = p % self.page_size
        st.kv[page, off], st.tok[page, off], st.where[page, off] = kv, token, p
        return True

    # ------------------------------------------------------------------ the verbs

    def init_decode_state(self, slots: int, num_pages: int | None = None) -> FakeState:
        n = slots * self.max_pages if num_pages is None else num_pages
        cells = (n, self.page_size)
        return FakeState(
            np.zeros(cells, np.int64),
            np.zeros(cells, np.int64),
            np.full(cells, -1, np.int32),
            np.full((slots, self.max_pages), n, np.int32),
            Rows.empty(slots, self.max_pages, n),
        )

    def set_table(self, state: FakeState, table: np.ndarray) -> FakeState:
        assert table.shape == state.table.shape and table.dtype == np.int32, table
        assert ((table >= 0) & (table <= state.num_pages)).all(), table
        self._called("set_table", None)
        st = self._take(state)
        st.table = table.copy()
        return st

    def prefill(self, state: FakeState, chunks: Sequence[Chunk]) -> tuple[FakeState, Prefill]:
        longest = max(len(c.tokens) for c in chunks)
        bucket = self.bucket_for(longest)
        mode = "fresh" if all(c.start == 0 for c in chunks) else "extend"
        rows = row_bucket(len(chunks))
        lengths, starts = [len(c.tokens) for c in chunks], [c.start for c in chunks]
        self._called("prefill", (mode, rows, bucket), lengths, starts, rows)
        ps, n_pages = self.page_size, state.num_pages
        for i, c in enumerate(chunks):  # the engine's checks (ValueError, state untouched)
            end = c.start + len(c.tokens)
            if not c.tokens or c.start < 0 or end > self.max_len:
                raise ValueError(f"chunk {i}: {len(c.tokens)} tokens from {c.start}")
            if not -(-end // ps) <= len(c.pages) <= self.max_pages:
                raise ValueError(f"chunk {i}: {len(c.pages)} pages for {end} tokens")
            if any(not 0 <= p < n_pages for p in c.pages):
                raise ValueError(f"chunk {i}: a page id outside the pool of {n_pages} pages")
            for prompt in self._poison:
                if tuple(prompt[c.start : end]) == tuple(c.tokens):
                    raise RuntimeError("prefill broke on a poisoned prompt")
        st = self._take(state)
        pre = Rows.empty(rows, self.max_pages, n_pages)
        for i, c in enumerate(chunks):
            kv = self._read(st, c.pages, c.start, f"prefill row {i}")
            for j, t in enumerate(c.tokens):
                kv = chain(kv, t)
                self._write(st, c.pages, c.start + j, kv, t)
            pre.table[i, : len(c.pages)] = c.pages
            if not c.last:
                pre.tokens[i], pre.done[i] = NO_TOKEN, False
                continue
            sp = c.sampling
            tok = next_token(kv, sp.seed, c.generated)
            pre.seed[i], pre.pos[i], pre.tokens[i] = sp.seed, c.start + len(c.tokens), tok
            pre.generated[i], pre.max_new[i] = c.generated + 1, sp.max_new_tokens
            pre.stop[i, : len(sp.stop_token_ids)] = sp.stop_token_ids
            pre.done[i] = tok in sp.stop_token_ids or c.generated + 1 >= sp.max_new_tokens
        last = tuple(c.last for c in chunks)
        return st, Prefill(pre, pre.tokens.copy(), pre.done.copy(), bucket, last)

    def insert(self, prefix: Prefill, state: FakeState, slots: Sequence[int]) -> FakeState:
        rows = prefix.state
        assert len(slots) == len(prefix.last), (slots, prefix.last)
        chosen = [s for s, last in zip(slots, prefix.last, strict=True) if last and s >= 0]
        assert len(set(chosen)) == len(chosen) and all(s < state.slots for s in chosen), slots
        self._called("insert", (len(rows.done), state.slots), state.slots, list(slots))
        st = self._take(state)
        for row, (slot, last) in enumerate(zip(slots, prefix.last, strict=True)):
            if slot >= 0 and last:  # the row and its page-table row
                st.rows.put(slot, rows, row)
                st.table[slot] = rows.table[row]
        return st

    def generate(self, state: FakeState, k: int) -> tuple[FakeState, np.ndarray, np.ndarray]:
        self._called("generate", (k, state.slots), state.slots, threading.current_thread().name)
        self.gate.wait()
        st = self._take(state)
        r_ = st.rows
        out = np.full((k, st.slots), NO_TOKEN, np.int32)
        for i in range(k):
            if r_.done.all():
                break
            for r in np.flatnonzero(~r_.done):
                pages, p = st.table[r], int(r_.pos[r])
                kv = chain(self._read(st, pages, p, f"decode row {r}"), int(r_.tokens[r]))
                if not self._write(st, pages, p, kv, int(r_.tokens[r])):
                    raise self._fault(f"decode row {r} wrote position {p} to NO_PAGE")
                tok = next_token(kv, int(r_.seed[r]), int(r_.generated[r]))
                out[i, r] = r_.tokens[r] = tok
                r_.generated[r] += 1
                r_.pos[r] += 1
                r_.done[r] = tok in r_.stop[r] or r_.generated[r] >= r_.max_new[r]
        return st, out, r_.done.copy()


__all__ = ["FakeEngine", "FakeState", "PageFault", "Prefill", "Rows", "chain"]
