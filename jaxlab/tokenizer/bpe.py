"""Byte-level BPE trainer whose output is a tiktoken ``mergeable_ranks`` table.

We only *train* here; all encoding and decoding is done by ``tiktoken`` (see
``encoding.py``). The output format is therefore tiktoken's: a mapping from token bytes
to rank, where ranks 0..255 are the 256 single bytes in byte order (so any byte string
can be encoded: byte fallback never fails) followed by the learned merges in the order
they were learned (tiktoken merges the lowest-rank pair first, so rank == merge priority).

The algorithm is the standard fast one:

* pre-tokenise with the GPT-2 regex and count unique pre-tokens (a ``Counter``), so the
  work scales with the number of *distinct* words, not the corpus size;
* keep a count for every adjacent token pair plus an index pair -> {word indices}, and
  after each merge rewrite only the words that contain the merged pair;
* pick the most frequent pair from a max-heap with lazy invalidation: entries whose
  stored count no longer matches the live count are dropped (or re-pushed with the live
  count) when popped, so we never have to delete from the heap.

Ties are broken by the lexicographically smallest ``(left bytes, right bytes)`` pair, so
training is a pure function of the input texts and ``vocab_size``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable

import regex

# The GPT-2 / tiktoken ``r50k_base`` pre-tokenisation pattern. The same string is handed to
# tiktoken as ``pat_str`` so training and encoding split text identically. The ``regex``
# package (a tiktoken dependency) is used because it supports ``\p{..}`` classes and its
# ``\s`` is Unicode White_Space, matching the Rust regex engine inside tiktoken.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
# Special tokens get the ids right after the learned ranks, in this order.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, PAD)
# The chat template's tokens (``jaxlab.tokenizer.chat``): a tokenizer trained with
# ``tokenizer.chat_tokens = true`` appends them after SPECIAL_TOKENS, in this order, so
# every id a tokenizer without them gives is unchanged.
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END_OF_TURN = "<|end|>"
CHAT_TOKENS: tuple[str, ...] = (SYSTEM, USER, ASSISTANT, END_OF_TURN)

N_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = N_BYTE_TOKENS + len(SPECIAL_TOKENS)  # 258: bytes + specials, no merges

_PRETOKEN_RE = regex.compile(GPT2_PAT_STR)

Pair = tuple[int, int]
Word = tuple[int, ...]


def validate_vocab_size(vocab_size: object) -> int:
    """Return ``vocab_size`` as an int, or raise ``ValueError`` naming the config field."""
    # bool is an int subclass; ``vocab_size=True`` is certainly a mistake.
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(
            f"tokenizer.vocab_size must be an integer >= {MIN_VOCAB_SIZE} "
            f"({N_BYTE_TOKENS} byte tokens + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size!r} of type {type(vocab_size).__name__}"
        )
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer.vocab_size must be >= {MIN_VOCAB_SIZE} "
            f"({N_BYTE_TOKENS} byte tokens + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size}"
        )
    return vocab_size


def byte_ranks() -> dict[bytes, int]:
    """The 256 single-byte ranks (byte value == rank): the base of every vocabulary."""
    return {bytes([b]): b for b in range(N_BYTE_TOKENS)}


def count_pretokens(texts: Iterable[str]) -> Counter[str]:
    """Count GPT-2 pre-tokens over ``texts`` (streamed: one text in memory at a time)."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(_PRETOKEN_RE.findall(text))
    return counts


def _merge_word(word: Word, left: int, right: int, new: int) -> Word:
    """Replace every non-overlapping ``(left, right)`` in ``word``, scanning left to right."""
    out: list[int] = []
    i = 0
    n = len(word)
    while i < n:
        if i + 1 < n and word[i] == left and word[i + 1] == right:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_bpe(texts: Iterable[str], vocab_size: int) -> dict[bytes, int]:
    """Learn byte-level BPE ranks from ``texts``.

    Args:
        texts: the training corpus, streamed. A single ``str`` is treated as one text
            (not as an iterable of characters).
        vocab_size: the final vocabulary size *including* the two special tokens, so at
            most ``vocab_size - 258`` merges are learned. Must be >= 258.

    Returns:
        ``{token bytes: rank}`` with ranks ``0..n-1``: the 256 single bytes in byte order,
        then merged tokens in the order they were learned. ``n <= vocab_size - 2``.

    If the corpus runs out of adjacent pairs before ``vocab_size`` is reached (every
    pre-token is already a single token), training stops early and the vocabulary is
    smaller than requested; callers can see this from ``len(result) + 2 < vocab_size``.
    """
    n_merges = validate_vocab_size(vocab_size) - MIN_VOCAB_SIZE
    if isinstance(texts, str):
        texts = [texts]

    # Token id -> bytes, and the reverse. Ids are ranks.
    vocab: list[bytes] = [bytes([b]) for b in range(N_BYTE_TOKENS)]
    ranks: dict[bytes, int] = byte_ranks()
    if n_merges == 0:
        return ranks

    # Distinct pre-tokens as tuples of byte ids. Single-byte words can never contain a pair,
    # so they are dropped up front (they are common: spaces, punctuation).
    words: list[Word] = []
    freqs: list[int] = []
    for piece, freq in count_pretokens(texts).items():
        word = tuple(piece.encode("utf-8"))
        if len(word) > 1:
            words.append(word)
            freqs.append(freq)

    pair_counts: defaultdict[Pair, int] = defaultdict(int)
    where: defaultdict[Pair, set[int]] = defaultdict(set)
    for idx, word in enumerate(words):
        freq = freqs[idx]
        for pair in itertools.pairwise(word):
            pair_counts[pair] += freq
            where[pair].add(idx)

    # Max-heap via negated counts; then the byte strings give the deterministic tie-break.
    # Token bytes are unique (see the duplicate handling below), so (bytes, bytes) identifies
    # a pair and the trailing ids never take part in a comparison.
    heap: list[tuple[int, bytes, bytes, int, int]] = [
        (-count, vocab[a], vocab[b], a, b) for (a, b), count in pair_counts.items()
    ]
    heapq.heapify(heap)

    learned = 0
    while learned < n_merges and heap:
        neg_count, _, _, a, b = heapq.heappop(heap)
        live = pair_counts.get((a, b), 0)
        if live != -neg_count:
            # Stale entry. Counts only *increase* for pairs that contain the token just
            # created, and those are pushed fresh below; a decreased count is re-pushed here.
            if 0 < live < -neg_count:
                heapq.heappush(heap, (-live, vocab[a], vocab[b], a, b))
            continue

        merged = vocab[a] + vocab[b]
        new = ranks.get(merged)
        if new is None:
            # A genuinely new token: it takes the next rank.
            new = len(vocab)
            vocab.append(merged)
            ranks[merged] = new
            learned += 1
        # else: the same bytes were already learned via a different split (e.g. "ab"+"c" vs
        # "a"+"bc"). tiktoken keys ranks by bytes, so reuse the existing id and spend no rank;
        # tiktoken will form it either way because it merges any pair whose bytes are a rank.

        touched: set[Pair] = set()
        for idx in list(where[(a, b)]):
            old_word = words[idx]
            new_word = _merge_word(old_word, a, b, new)
            words[idx] = new_word
            freq = freqs[idx]
            old_pairs = list(itertools.pairwise(old_word))
            new_pairs = list(itertools.pairwise(new_word))
            for pair in old_pairs:
                pair_counts[pair] -= freq
            for pair in new_pairs:
                pair_counts[pair] += freq
                if new in pair:
                    touched.add(pair)
            new_set = set(new_pairs)
            for pair in set(old_pairs) - new_set:
                where[pair].discard(idx)
            for pair in new_set:
                where[pair].add(idx)

        # Every occurrence of (a, b) has been merged away; drop the bookkeeping.
        pair_counts.pop((a, b), None)
        where.pop((a, b), None)
        for pair in touched:
            count = pair_counts[pair]
            if count > 0:
                x, y = pair
                heapq.heappush(heap, (-count, vocab[x], vocab[y], x, y))

    return ranks
