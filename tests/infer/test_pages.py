"""The page allocator (:mod:`jaxlab.infer.pages`): a hypothesis state machine over every
verb the scheduler uses, plus examples of each prefix-caching rule.

The machine models the device too: each page remembers the tokens whose K/V were last
written through it. A cache hit must then hold exactly the prompt prefix it is reused for,
and a page is only ever written by a sequence that holds it alone.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jaxlab.infer.pages import Admission, PagePool, default_num_pages, pages_for_budget

# Two token values and short prompts: prefixes repeat, so hits, shared pages, concurrent
# commits of one prefix and evictions all happen within a few steps.
PROMPTS = st.lists(st.integers(0, 1), min_size=1, max_size=10)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(1, 1)
        self.tokens: dict[int, list[int]] = {}  # live sequence -> its tokens so far
        self.computed: dict[int, int] = {}  # live sequence -> tokens whose K/V are written
        self.written: dict[int, tuple[int, ...]] = {}  # page -> prefix its K/V belong to
        self.next_id = 0

    @initialize(num_pages=st.integers(1, 12), page_size=st.integers(1, 3), caching=st.booleans())
    def start(self, num_pages: int, page_size: int, caching: bool) -> None:
        self.pool = PagePool(num_pages, page_size, prefix_caching=caching)

    def write(self, seq: int, upto: int) -> None:
        """Compute ``seq``'s tokens up to ``upto``: the device writes their pages."""
        ps, pages = self.pool.page_size, self.pool.pages(seq)
        for i in range(self.computed[seq] // ps, -(-upto // ps)):
            holders = [s for s in self.tokens if pages[i] in self.pool.pages(s)]
            assert holders == [seq], f"page {pages[i]} written while shared by {holders}"
            self.written[pages[i]] = tuple(self.tokens[seq][: min(upto, (i + 1) * ps)])
        self.computed[seq] = upto

    def snapshot(self) -> tuple:
        pool = self.pool
        return (
            pool.free,
            pool.used,
            pool.queries,
            pool.hits,
            {s: pool.pages(s) for s in self.tokens},
        )

    @rule(prompt=PROMPTS, reserve=st.integers(0, 3))
    def admit(self, prompt: list[int], reserve: int) -> None:
        self.admit_prompt(prompt, reserve)

    @rule(n_pages=st.integers(1, 12))
    def pressure(self, n_pages: int) -> None:
        """A prompt no one else has, as long as most of the pool: it evicts cached pages."""
        self.admit_prompt(list(range(100, 100 + n_pages * self.pool.page_size)), 0)

    def admit_prompt(self, prompt: list[int], reserve: int) -> None:
        pool, ps = self.pool, self.pool.page_size
        seq, self.next_id = self.next_id, self.next_id + 1
        before = self.snapshot()
        got = pool.admit(seq, prompt, reserve)
        if got is None:
            assert self.snapshot() == before
            assert pool.pages_for(len(prompt) + reserve) > pool.free
            return
        assert got.pages == pool.pages(seq)
        assert len(got.pages) == pool.pages_for(len(prompt) + reserve)
        n_cached = got.cached_tokens // ps
        assert got.cached_tokens == n_cached * ps <= (len(prompt) - 1) // ps * ps
        assert pool.hits - before[3] == got.cached_tokens
        assert pool.prefix_caching or got.cached_tokens == 0
        for i, page in enumerate(got.pages[:n_cached]):
            assert self.written[page] == tuple(prompt[: (i + 1) * ps]), "a hit holds other K/V"
        self.tokens[seq], self.computed[seq] = list(prompt), got.cached_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def prefill_chunk(self, data: st.DataObject, chunk: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        upto = min(len(self.tokens[seq]), self.computed[seq] + chunk)
        self.write(seq, upto)
        self.pool.commit(seq, self.tokens[seq], upto)
        before = self.snapshot()
        self.pool.commit(seq, self.tokens[seq], upto)  # idempotent
        assert self.snapshot() == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 4))
    def decode(self, data: st.DataObject, k: int) -> None:
        """Grow a fully prefilled sequence by ``k`` tokens and write them, as generate does."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[seq])
        if self.computed[seq] < n:
            return
        before = self.snapshot()
        if not self.pool.grow(seq, n + k):
            assert self.snapshot() == before
            return
        assert len(self.pool.pages(seq)) >= self.pool.pages_for(n + k)
        self.tokens[seq] += data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k))
        self.write(seq, n + k)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), finished=st.booleans())
    def release(self, data: st.DataObject, finished: bool) -> None:
        """Finish (only after its prompt is computed) or cancel (at any point)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if finished and self.computed[seq] < len(self.tokens[seq]):
            return
        self.pool.release(seq)
        del self.tokens[seq], self.computed[seq]
        assert seq not in self.pool
        self.pool.release(seq)  # a second path releasing it: no-op
        with pytest.raises(KeyError):
            self.pool.pages(seq)

    @invariant()
    def consistent(self) -> None:
        pool, ps = self.pool, self.pool.page_size
        pool.check()
        assert pool.free + pool.used == pool.num_pages
        owners: dict[int, list[int]] = {}
        for seq in self.tokens:
            for page in pool.pages(seq):
                owners.setdefault(page, []).append(seq)
                if len(owners[page]) > 1:  # shared: a full, computed, matching prefix page
                    for s in owners[page]:
                        j = pool.pages(s).index(page)
                        assert (j + 1) * ps <= self.computed[s]
                        assert self.written[page] == tuple(self.tokens[s][: (j + 1) * ps])
        assert pool.used == len(owners)
        assert all(pool.refcount(p) == len(s) for p, s in owners.items())

    def teardown(self) -> None:
        for seq in list(self.tokens):
            self.pool.release(seq)
        self.pool.check()
        assert self.pool.used == 0
        assert self.pool.free == self.pool.num_pages
        assert all(self.pool.refcount(p) == 0 for p in range(self.pool.num_pages))


PoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, derandomize=True
)
TestPoolMachine = PoolMachine.TestCase


def filled(pool: PagePool, seq: str, tokens: list[int], reserve: int = 0) -> Admission:
    """Admit, prefill whole and commit: what the scheduler does for a short prompt."""
    got = pool.admit(seq, tokens, reserve)
    assert got is not None
    pool.commit(seq, tokens, len(tokens))
    return got


def test_a_new_prompt_reuses_the_longest_cached_prefix():
    pool = PagePool(16, 4, prefix_caching=True)
    a = filled(pool, "a", list(range(14)))  # 3 full pages and a partial one
    b = pool.admit("b", [*range(8), 99, 99, 99, 99, 5, 5])
    assert b is not None
    assert b.cached_tokens == 8
    assert b.pages[:2] == a.pages[:2]
    assert not set(b.pages[2:]) & set(a.pages)
    assert [pool.refcount(p) for p in a.pages[:3]] == [2, 2, 1]
    pool.release("a")
    assert pool.pages("b")[:2] == a.pages[:2]  # still held by b
    pool.check()


def test_a_prefix_differing_in_its_first_page_misses_even_if_later_pages_match():
    pool = PagePool(16, 2, prefix_caching=True)
    filled(pool, "a", [1, 2, 3, 4, 5])
    b = pool.admit("b", [9, 2, 3, 4, 5])  # page 2 has the same tokens, another chain
    assert b is not None and b.cached_tokens == 0


def test_the_last_prompt_token_is_always_computed():
    pool = PagePool(16, 4, prefix_caching=True)
    a = filled(pool, "a", list(range(12)))
    pool.release("a")
    again = pool.admit("again", list(range(12)))  # exactly 3 cached full pages
    assert again is not None
    assert again.cached_tokens == 8
    assert again.pages[:2] == a.pages[:2] and again.pages[2] != a.pages[2]
    longer = pool.admit("longer", list(range(13)))
    assert longer is not None and longer.cached_tokens == 12


def test_unreferenced_cached_pages_are_evicted_least_recently_released_first():
    pool = PagePool(6, 2, prefix_caching=True)
    for name in "abc":
        filled(pool, name, [ord(name), 0, 1])  # a full page (cached) and a partial one (freed)
        pool.release(name)
    assert (pool.free, pool.used) == (6, 0)
    assert pool.admit("x", [7] * 8) is not None  # 4 pages: the 3 free ones, then a's
    pool.release("x")  # never committed: its pages go back to the free list
    hits = {name: pool.admit(name, [ord(name), 0, 1]) for name in "cba"}
    assert {k: v.cached_tokens for k, v in hits.items() if v} == {"a": 0, "b": 2, "c": 2}
    pool.check()


def test_a_sequence_s_tail_pages_are_evicted_before_its_head():
    pool = PagePool(5, 1, prefix_caching=True)
    filled(pool, "a", [1, 2, 3, 4])  # keys the pages of 1, 1-2, 1-2-3, 1-2-3-4
    pool.release("a")
    filled(pool, "x", [9, 9])  # the free page, then one eviction: a's last page, not its first
    pool.release("x")
    got = pool.admit("b", [1, 2, 3, 4, 5])
    assert got is not None and got.cached_tokens == 3


def test_without_prefix_caching_nothing_hits_and_nothing_is_counted():
    pool = PagePool(8, 2)
    a = filled(pool, "a", [1, 2, 3, 4, 5])
    b = pool.admit("b", [1, 2, 3, 4, 5])
    assert b is not None and b.cached_tokens == 0
    assert not set(a.pages) & set(b.pages)
    pool.release("a")
    pool.release("b")
    assert (pool.free, pool.queries, pool.hits) == (8, 0, 0)
    pool.check()


def test_a_failed_admit_or_grow_changes_nothing():
    pool = PagePool(4, 2, prefix_caching=True)
    filled(pool, "a", [1, 2, 3])
    pool.release("a")  # page [1, 2] cached, evictable
    filled(pool, "b", [5, 6, 7])
    state = (pool.free, pool.used, pool.queries, pool.hits, pool.pages("b"))
    assert pool.admit("c", [1, 2, 3], reserve=4) is None  # 1 hit + 3 fresh, 2 free
    assert pool.grow("b", 9) is False  # 5 pages
    assert (pool.free, pool.used, pool.queries, pool.hits, pool.pages("b")) == state
    assert "c" not in pool
    c = pool.admit("c", [1, 2, 3])  # the failed admit evicted nothing
    assert c is not None and c.cached_tokens == 2
    pool.check()


def test_prefix_cache_stats_count_prompt_tokens():
    pool = PagePool(16, 4, prefix_caching=True)
    filled(pool, "a", list(range(10)))
    filled(pool, "b", list(range(10)))
    filled(pool, "c", [*range(4), 50, 51])
    assert pool.queries == 10 + 10 + 6
    assert pool.hits == 8 + 4


def test_two_sequences_prefilling_one_prefix_keep_the_first_commit():
    pool = PagePool(8, 2, prefix_caching=True)
    a = pool.admit("a", [1, 2, 3])
    b = pool.admit("b", [1, 2, 3])
    assert a is not None and b is not None and b.cached_tokens == 0
    pool.commit("a", [1, 2, 3], 3)
    pool.commit("b", [1, 2, 3], 3)  # same key: a's page stays the cached one
    pool.check()
    pool.release("b")
    assert pool.free == 8 - len(a.pages)  # b's private pages went straight back
    c = pool.admit("c", [1, 2, 3])
    assert c is not None and c.cached_tokens == 2 and c.pages[0] == a.pages[0]


def test_commit_keys_pages_chunk_by_chunk():
    pool = PagePool(8, 2, prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    assert pool.admit("a", tokens) is not None
    pool.commit("a", tokens, 3)  # one full page computed
    b = pool.admit("b", tokens)
    assert b is not None and b.cached_tokens == 2
    pool.commit("a", tokens, 5)
    c = pool.admit("c", tokens)
    assert c is not None and c.cached_tokens == 4


def test_unknown_sequences():
    pool = PagePool(4, 2, prefix_caching=True)
    pool.release("nobody")  # the server may release on several paths
    for call in (lambda: pool.pages("nobody"), lambda: pool.grow("nobody", 3)):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(KeyError):
        pool.commit("nobody", [1, 2], 2)
    assert pool.admit("a", [1]) is not None
    with pytest.raises(ValueError, match="already holds"):
        pool.admit("a", [1])


def test_pool_sizing_helpers():
    assert default_num_pages(slots=4, max_len=100, page_size=16) == 4 * 7
    # 2 layers x (K + V) x 16 tokens x 4 heads x 64 dims x 4 bytes = 64 KiB a page.
    sizes = dict(page_size=16, n_layers=2, n_kv_heads=4, head_dim=64, dtype_bytes=4)
    assert pages_for_budget(1.0, **sizes) == 16
    assert pages_for_budget(1.03, **sizes) == 16
    with pytest.raises(ValueError, match="holds no page"):
        pages_for_budget(0.05, **sizes)
