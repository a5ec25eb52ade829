"""Tests for the BPE trainer (``jaxlab.tokenizer.bpe``)."""

from __future__ import annotations

import itertools
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.tokenizer import GPT2_PAT_STR, MIN_VOCAB_SIZE, count_pretokens, train_bpe
from jaxlab.tokenizer.bpe import byte_ranks


def _stdlib_corpus(limit_bytes: int) -> list[str]:
    """Real text that needs no download: the interpreter's own stdlib sources."""
    texts: list[str] = []
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text.encode("utf-8"))
        if total >= limit_bytes:
            break
    return texts


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _stdlib_corpus(300_000)


@pytest.fixture(scope="module")
def ranks(corpus: list[str]) -> dict[bytes, int]:
    return train_bpe(corpus, 1024)


def _reference_train(texts: list[str], vocab_size: int) -> dict[bytes, int]:
    """Obviously-correct O(merges * corpus) BPE: recount every pair after every merge."""
    words: Counter[tuple[bytes, ...]] = Counter()
    for piece, n in count_pretokens(texts).items():
        words[tuple(bytes([b]) for b in piece.encode("utf-8"))] += n
    ranks = byte_ranks()
    learned = 0
    while learned < vocab_size - MIN_VOCAB_SIZE:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        # Highest count, then smallest (left bytes, right bytes).
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        if merged not in ranks:
            ranks[merged] = len(ranks)
            learned += 1
        new_words: Counter[tuple[bytes, ...]] = Counter()
        for word, n in words.items():
            out: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return ranks


def test_ranks_start_with_bytes_then_merges(ranks: dict[bytes, int]) -> None:
    assert sorted(ranks.values()) == list(range(len(ranks)))
    for b in range(256):
        assert ranks[bytes([b])] == b
    # Every learned token is the concatenation of two strictly lower-ranked tokens, which is
    # what makes it reachable by tiktoken's lowest-rank-first merging.
    for token, rank in ranks.items():
        if rank < 256:
            continue
        assert len(token) >= 2
        assert any(
            ranks.get(token[:k], rank) < rank and ranks.get(token[k:], rank) < rank
            for k in range(1, len(token))
        ), token


def test_vocab_size_exactly_honoured(ranks: dict[bytes, int]) -> None:
    assert len(ranks) + 2 == 1024


def test_deterministic(corpus: list[str], ranks: dict[bytes, int]) -> None:
    again = train_bpe(iter(corpus), 1024)  # also: a one-shot iterator is fine
    assert list(again.items()) == list(ranks.items())


def test_matches_reference_on_real_text(corpus: list[str]) -> None:
    small = corpus[:3]
    assert train_bpe(small, 400) == _reference_train(small, 400)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.text(alphabet="ab c\n", max_size=40), min_size=1, max_size=6),
    st.integers(min_value=MIN_VOCAB_SIZE, max_value=300),
)
def test_matches_reference_on_random_corpora(texts: list[str], vocab_size: int) -> None:
    # A tiny alphabet makes ties, overlapping runs ("aaa") and early stops common.
    assert train_bpe(texts, vocab_size) == _reference_train(texts, vocab_size)


def test_tiktoken_roundtrip_and_common_words(corpus: list[str], ranks: dict[bytes, int]) -> None:
    enc = tiktoken.Encoding(
        name="test-bpe", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks, special_tokens={}
    )
    text = "".join(corpus[:20])
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) / 2  # it actually compresses
    for word in [" the", " def", " return", " self", " None", " and", "\n   "]:
        assert len(enc.encode_ordinary(word)) == 1, word


def test_stops_early_when_pairs_run_out() -> None:
    # Pre-tokens: "ab" x1, " ab" x2. Learnable merges: "ab", then " ab"; then nothing is left
    # to merge, so training stops with 258 ranks (n_vocab 260) instead of the 1000 asked for.
    ranks = train_bpe(["ab ab ab"], 1000)
    assert ranks == {**byte_ranks(), b"ab": 256, b" ab": 257}


def test_empty_corpus_gives_byte_ranks() -> None:
    assert train_bpe([], 500) == byte_ranks()
    assert train_bpe([""], 500) == byte_ranks()


def test_tie_break_is_smallest_byte_pair() -> None:
    # All three pairs occur once; (b" ", b"c") < (b"a", b"b") < (b"c", b"d").
    assert train_bpe(["ab cd"], MIN_VOCAB_SIZE + 1) == {**byte_ranks(), b" c": 256}


def test_single_str_is_one_text() -> None:
    assert train_bpe("hello hello", 300) == train_bpe(["hello hello"], 300)


def test_minimum_vocab_size_learns_nothing() -> None:
    assert train_bpe(["hello world"], MIN_VOCAB_SIZE) == byte_ranks()


@pytest.mark.parametrize("bad", [0, 1, 257, -5])
def test_invalid_vocab_size_raises(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"tokenizer\.vocab_size.*258.*got {bad}"):
        train_bpe(["hello"], bad)


@pytest.mark.parametrize("bad", [300.0, "300", None, True])
def test_non_int_vocab_size_raises(bad: object) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.vocab_size"):
        train_bpe(["hello"], bad)  # type: ignore[arg-type]
