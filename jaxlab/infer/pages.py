"""The host-side page allocator of the paged KV cache, with prefix caching.

:class:`PagePool` owns which sequence holds which of the ``num_pages`` KV pages of one
decode state, and which pages hold a reusable prompt prefix. It decides, the caller acts:
it holds no device arrays, imports no jax and does no I/O, so the scheduler can ask it
every step and the tests can drive it with hypothesis alone. The engine learns the result
as page-table rows (``engine.set_table``); see the shared design of issue #33.

vLLM's block manager is the model (``kv_cache_manager.py``, ``block_pool.py``):

- a page is *free* (unkeyed, unreferenced), *evictable* (keyed by a prompt prefix,
  unreferenced, still a cache hit) or *used* (referenced by at least one sequence);
- a full page of computed tokens is keyed by a hash chain over the pages before it and its
  own tokens, so a new sequence finds its longest cached prefix page by page; the chain's
  root is a per-sequence ``salt`` (vLLM's extra keys), so K/V computed under one LoRA
  adapter is never a hit for another (the same tokens give other K/V);
- cached pages are shared read-only by refcount: a sequence only ever writes pages past its
  cached prefix, which it got fresh, so no page is shared writable;
- fresh pages come from the free list first, then from the evictable pages least recently
  released first.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """What :meth:`PagePool.admit` gave a sequence: its page list, of which the first
    ``cached_tokens // page_size`` pages already hold the K/V of its first
    ``cached_tokens`` tokens (prefill starts there)."""

    pages: list[int]
    cached_tokens: int


@dataclass
class _Seq:
    pages: list[int]
    n_keyed: int = 0  # leading pages already looked up or keyed by admit/commit
    digest: bytes = b""  # chain digest of page n_keyed - 1 (b"": the chain's root)


def _page_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page: sha256 over the previous page's digest and this page's
    token ids (fixed width, so the encoding is unambiguous).

    Why a cryptographic digest and not Python's ``hash`` of a tuple: a collision here is not
    a slow path but a wrong answer (a request attends to another prompt's K/V), and 64-bit
    ``hash`` collisions can be found on purpose. Why not the token tuple chain itself: the
    digest keeps a key at 32 bytes and its comparison O(1) however long the prefix.
    """
    return hashlib.sha256(previous + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def chain_root(salt: bytes) -> bytes:
    """The digest a hash chain of ``salt`` starts from: ``b""`` for no salt (the chains of
    a server without adapters are unchanged), otherwise a digest of the salt, which no
    page's digest equals."""
    return b"" if not salt else hashlib.sha256(b"salt:" + salt).digest()


class PagePool:
    """Pages ``0 .. num_pages-1`` of one decode state, lent to sequences (any hashable id).

    ``admit`` a sequence (cached prefix + fresh pages), ``grow`` it as it decodes,
    ``commit`` its computed prompt pages after each prefill chunk so later admits can hit,
    ``release`` it on every way out. A failed ``admit`` or ``grow`` changes nothing.
    ``queries`` and ``hits`` count prompt tokens asked about by successful admits and those
    served from the cache (both stay 0 without ``prefix_caching``).
    """

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = False) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.queries = 0
        self.hits = 0
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 is lent first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._seqs: dict[Hashable, _Seq] = {}

    @property
    def free(self) -> int:
        """Pages a sequence could get now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - self.free

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def pages(self, seq: Hashable) -> list[int]:
        """``seq``'s pages in position order (a copy). KeyError if it holds none."""
        return list(self._seqs[seq].pages)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def admit(
        self, seq: Hashable, tokens: Sequence[int], reserve: int = 0, *, salt: bytes = b""
    ) -> Admission | None:
        """Pages for ``seq``'s ``tokens`` plus ``reserve`` more: its longest cached prefix of
        full pages, then fresh ones. None, and nothing changed, if they do not fit.

        ``salt`` roots the sequence's hash chain: only sequences of the same salt share
        pages (:func:`chain_root`; the server salts by LoRA adapter).

        The cache may serve at most ``(len(tokens) - 1) // page_size`` pages, so that at
        least the last prompt token is computed: its logits give the first new token.
        """
        if seq in self._seqs:
            raise ValueError(f"sequence {seq!r} already holds pages; release it first")
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        ps = self.page_size
        hits: list[int] = []
        digest = chain_root(salt)
        if self.prefix_caching:
            for i in range(max(0, (len(tokens) - 1) // ps)):
                next_digest = _page_digest(digest, tokens[i * ps : (i + 1) * ps])
                page = self._page_of.get(next_digest)
                if page is None:
                    break
                hits.append(page)
                digest = next_digest
        n_fresh = max(0, self.pages_for(len(tokens) + reserve) - len(hits))
        revived = sum(1 for p in hits if self._refs[p] == 0)  # evictable now, theirs soon
        if n_fresh > self.free - revived:
            return None
        for page in hits:
            self._evictable.pop(page, None)
            self._refs[page] += 1
        pages = hits + self._take(n_fresh)
        self._seqs[seq] = _Seq(pages, n_keyed=len(hits), digest=digest)
        if self.prefix_caching:
            self.queries += len(tokens)
            self.hits += len(hits) * ps
        return Admission(list(pages), len(hits) * ps)

    def grow(self, seq: Hashable, n_tokens: int) -> bool:
        """Make ``seq``'s pages cover ``n_tokens`` tokens. False, and nothing changed, if the
        pool cannot. KeyError for a sequence that holds no pages."""
        held = self._seqs[seq].pages
        n_new = self.pages_for(n_tokens) - len(held)
        if n_new > self.free:
            return False
        if n_new > 0:
            held.extend(self._take(n_new))
        return True

    def commit(self, seq: Hashable, tokens: Sequence[int], n_computed: int) -> None:
        """The full pages of ``tokens[:n_computed]`` hold valid K/V now: key them so later
        admits can hit. ``tokens`` are the ones ``seq`` was admitted with (or a longer run of
        them); committing again, or fewer tokens, is a no-op.

        Two sequences may prefill the same prefix at once: the first to commit keys its
        page; the other's page stays private, and is freed on release like any other.
        """
        held = self._seqs[seq]
        if not self.prefix_caching:
            return
        ps = self.page_size
        n_full = min(n_computed, len(tokens)) // ps
        if n_full > len(held.pages):
            raise ValueError(f"{n_full} full pages computed but {seq!r} holds {len(held.pages)}")
        for i in range(held.n_keyed, n_full):
            digest = _page_digest(held.digest, tokens[i * ps : (i + 1) * ps])
            page = held.pages[i]
            # Keyed already: this very page (a hit), or another's (this one stays private).
            if digest not in self._page_of:
                if page in self._key_of:
                    raise ValueError(f"page {page} of {seq!r} is keyed by other tokens")
                self._page_of[digest] = page
                self._key_of[page] = digest
            held.n_keyed, held.digest = i + 1, digest

    def release(self, seq: Hashable) -> None:
        """``seq`` gives its pages back (finish, cancel, disconnect, preemption, shutdown).
        Keyed pages nobody holds become evictable, the rest free. Releasing a sequence that
        holds no pages is a no-op: the server may release on several paths."""
        held = self._seqs.pop(seq, None)
        if held is None:
            return
        # Last page first: the evictable order then drops a prefix's tail before its head,
        # and a head page is what every longer hit needs.
        for page in reversed(held.pages):
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            if page in self._key_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def _take(self, n: int) -> list[int]:
        """``n`` pages (the caller checked they exist): free ones first, then evicted ones."""
        out: list[int] = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def check(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (for tests; O(pages))."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        held: dict[int, int] = {}
        for seq, s in self._seqs.items():
            require(len(set(s.pages)) == len(s.pages), f"{seq!r} holds a page twice")
            for page in s.pages:
                held[page] = held.get(page, 0) + 1
        for page in range(self.num_pages):
            require(self._refs[page] == held.get(page, 0), f"refcount of page {page}")
            require(held.get(page, 0) <= 1 or page in self._key_of, f"page {page} shared unkeyed")
        free, evictable = set(self._free), set(self._evictable)
        require(len(free) == len(self._free), "a page is on the free list twice")
        every = sorted([*free, *evictable, *held])
        require(every == list(range(self.num_pages)), "pages not in exactly one of the states")
        require(all(p not in self._key_of for p in free), "a free page is keyed")
        require(all(p in self._key_of for p in evictable), "an evictable page is not keyed")
        require(
            all(self._page_of.get(k) == p for p, k in self._key_of.items())
            and len(self._page_of) == len(self._key_of),
            "keys and pages are not one-to-one",
        )
        require(self.prefix_caching or not self._key_of, "a page is keyed without caching")
        require(len(free) + len(evictable) + len(held) == self.num_pages, "counts")


def default_num_pages(slots: int, max_len: int, page_size: int) -> int:
    """Pages for every slot to hold ``max_len`` tokens: the contiguous cache's memory."""
    return slots * math.ceil(max_len / page_size)


def pages_for_budget(
    mib: float,
    *,
    page_size: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    scale_bytes: int = 0,
) -> int:
    """Pages that ``mib`` MiB of KV cache holds: a page is K and V of ``page_size`` tokens
    in every layer, each token and kv head ``head_dim`` values of ``dtype_bytes`` and (an
    int8 pool) a scale of ``scale_bytes``. ValueError if not even one page fits."""
    per_head = head_dim * dtype_bytes + scale_bytes
    page_bytes = 2 * n_layers * page_size * n_kv_heads * per_head
    n = int(mib * 2**20 // page_bytes)
    if n < 1:
        raise ValueError(
            f"a KV cache budget of {mib} MiB holds no page: one page of {page_size} tokens"
            f" (K and V, {n_layers} layers) takes {page_bytes / 2**20:.4g} MiB"
        )
    return n
