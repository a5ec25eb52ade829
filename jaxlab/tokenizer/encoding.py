"""``Tokenizer``: a thin, typed wrapper around a ``tiktoken.Encoding`` built from our ranks.

tiktoken does all encoding and decoding (it is fast Rust and applies BPE by lowest rank
first, exactly the priority our trainer records). This module adds what the lab needs
around it: the two special tokens at fixed ids (and, with ``chat=True``, the four chat
tokens after them), a stable content hash, and a save/load format that is tiktoken's own
rank file plus a small JSON metadata file. A tokenizer saved without the chat tokens loads
and encodes exactly as before (its ``special_tokens`` and sha256 are unchanged).

On disk (``Tokenizer.save``)::

    tokenizer.tiktoken   one line per rank: base64(token bytes) + " " + rank, rank order
                         (the format ``tiktoken.load.load_tiktoken_bpe`` reads)
    tokenizer.json       kind, name, n_vocab, special tokens with ids, pat_str, sha256
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import tiktoken

from jaxlab.tokenizer.bpe import (
    CHAT_TOKENS,
    ENDOFTEXT,
    GPT2_PAT_STR,
    MIN_VOCAB_SIZE,
    N_BYTE_TOKENS,
    PAD,
    SPECIAL_TOKENS,
    byte_ranks,
    train_bpe,
)

TokenizerKind = Literal["byte", "bpe"]

RANKS_FILENAME = "tokenizer.tiktoken"
META_FILENAME = "tokenizer.json"
FORMAT_VERSION = 1


def ranks_file_bytes(ranks: dict[bytes, int]) -> bytes:
    """Serialise ranks in tiktoken's rank-file format (canonical: sorted by rank)."""
    lines = [
        base64.b64encode(token) + b" " + str(rank).encode("ascii") + b"\n"
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    return b"".join(lines)


def parse_ranks_file(content: bytes, source: str = RANKS_FILENAME) -> dict[bytes, int]:
    """Parse tiktoken's rank-file format.

    This mirrors ``tiktoken.load.load_tiktoken_bpe``. We do not call that function because
    it goes through ``read_file_cached``, which caches *local* files too, keyed by path, in
    ``$TMPDIR/data-gym-cache``: re-saving a tokenizer to the same path and loading it again
    would then return the stale cached ranks. Parsing bytes we have already read (and hashed)
    also means the hash check and the parse see the same content.
    """
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line:
            continue
        try:
            token_b64, rank_str = line.split()
            token = base64.b64decode(token_b64, validate=True)
            rank = int(rank_str)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{source}:{lineno}: malformed rank line {line!r}") from e
        if token in ranks:
            raise ValueError(f"{source}:{lineno}: duplicate token {token!r}")
        ranks[token] = rank
    return ranks


def _content_sha256(ranks_blob: bytes, special_tokens: dict[str, int], pat_str: str) -> str:
    """Hash everything that determines the token ids a text gets.

    The rank file alone is not enough: the same ranks with different special-token ids or a
    different split pattern encode differently, so those are hashed too (as canonical JSON).
    """
    h = hashlib.sha256()
    h.update(ranks_blob)
    h.update(b"\0")
    extra = {"pat_str": pat_str, "special_tokens": special_tokens}
    h.update(json.dumps(extra, sort_keys=True, ensure_ascii=True).encode("ascii"))
    return h.hexdigest()


def _check_ranks(ranks: dict[bytes, int]) -> None:
    """Reject rank tables tiktoken would mis-handle or that break byte fallback."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("ranks must be exactly 0..n-1 with no gaps or duplicates")
    for b in range(N_BYTE_TOKENS):
        if ranks.get(bytes([b])) != b:
            # With every single byte present at its own rank, any input can be encoded.
            raise ValueError(f"rank {b} must be the single byte {bytes([b])!r}")


class Tokenizer:
    """Byte-level BPE tokenizer; every encode/decode call goes straight to tiktoken.

    Ids ``0..n_ranks-1`` are the mergeable ranks (the first 256 are single bytes), then
    ``eot_id == n_ranks`` (``<|endoftext|>``) and ``pad_id == n_ranks + 1`` (``<|pad|>``);
    with ``chat=True`` the chat tokens (:data:`~jaxlab.tokenizer.bpe.CHAT_TOKENS`) follow
    at ``n_ranks + 2 ...``.
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        *,
        name: str,
        kind: TokenizerKind,
        pat_str: str = GPT2_PAT_STR,
        chat: bool = False,
    ) -> None:
        if kind not in get_args(TokenizerKind):
            raise ValueError(
                f"tokenizer kind must be one of {get_args(TokenizerKind)}, got {kind!r}"
            )
        _check_ranks(mergeable_ranks)
        n_ranks = len(mergeable_ranks)
        self._kind: TokenizerKind = kind
        self._ranks = dict(mergeable_ranks)  # private copy: the hash must stay valid
        specials = SPECIAL_TOKENS + (CHAT_TOKENS if chat else ())
        self._special_tokens = {tok: n_ranks + i for i, tok in enumerate(specials)}
        self._pat_str = pat_str
        self._ranks_blob = ranks_file_bytes(self._ranks)
        self._sha256 = _content_sha256(self._ranks_blob, self._special_tokens, pat_str)
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=pat_str,
            mergeable_ranks=self._ranks,
            special_tokens=dict(self._special_tokens),
            explicit_n_vocab=n_ranks + len(self._special_tokens),
        )

    # -- metadata -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._enc.name

    @property
    def kind(self) -> TokenizerKind:
        return self._kind

    @property
    def n_vocab(self) -> int:
        """Total ids including the special tokens (the embedding-table size)."""
        return self._enc.n_vocab

    @property
    def eot_id(self) -> int:
        return self._special_tokens[ENDOFTEXT]

    @property
    def pad_id(self) -> int:
        return self._special_tokens[PAD]

    @property
    def has_chat_tokens(self) -> bool:
        """Whether the chat template's tokens are in the vocabulary (``chat=True``)."""
        return CHAT_TOKENS[0] in self._special_tokens

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special_tokens)

    @property
    def pat_str(self) -> str:
        return self._pat_str

    @property
    def mergeable_ranks(self) -> dict[bytes, int]:
        """A copy of the rank table (token bytes -> rank)."""
        return dict(self._ranks)

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the saved rank-file content plus specials and pattern (stable)."""
        return self._sha256

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The underlying ``tiktoken.Encoding``, for anything not wrapped here."""
        return self._enc

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, kind={self.kind!r}, n_vocab={self.n_vocab}, "
            f"sha256={self.sha256[:12]}...)"
        )

    # -- encode / decode --------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Encode user text. Special-token strings in it are encoded as plain text.

        ``encode_ordinary`` is used so a document containing ``"<|endoftext|>"`` can never
        inject a real document boundary; callers append ``eot_id`` themselves.
        """
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], *, num_threads: int = 8) -> list[list[int]]:
        """Encode many texts on tiktoken's thread pool (its Rust core releases the GIL)."""
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Decode to raw bytes: for streaming, where a token may end mid UTF-8 character."""
        ids = list(ids)
        self._check_ids(ids)
        return self._enc.decode_bytes(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode to text; invalid UTF-8 (e.g. a truncated stream) becomes U+FFFD."""
        ids = list(ids)
        self._check_ids(ids)
        return self._enc.decode(ids, errors="replace")

    def _check_ids(self, ids: list[int]) -> None:
        # tiktoken raises a bare KeyError (or OverflowError for negatives); say what happened.
        # min/max run in C, so the common (valid) case stays cheap for long sequences.
        n = self.n_vocab
        if ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(i for i in ids if not 0 <= i < n)
            raise ValueError(f"token id {bad} out of range for n_vocab={n} ({self.name})")

    # -- persistence ------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write ``tokenizer.tiktoken`` and ``tokenizer.json`` into ``directory``; return it."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / RANKS_FILENAME).write_bytes(self._ranks_blob)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "name": self.name,
            "n_vocab": self.n_vocab,
            "special_tokens": self.special_tokens,
            "pat_str": self.pat_str,
            "sha256": self.sha256,
        }
        (out / META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load a tokenizer saved by ``save``, verifying its sha256.

        Raises ``ValueError`` if the files are missing pieces, malformed, or the content does
        not hash to the sha256 recorded at save time (a tampered or corrupted rank file).
        """
        src = Path(directory)
        try:
            meta = json.loads((src / META_FILENAME).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            from jaxlab.config.loader import not_utf8

            raise ValueError(f"{src / META_FILENAME}: {not_utf8(e)}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{src / META_FILENAME}: not JSON ({e})") from None
        try:
            kind = meta["kind"]
            name = meta["name"]
            pat_str = meta["pat_str"]
            special_tokens = {str(k): int(v) for k, v in meta["special_tokens"].items()}
            expected_sha = meta["sha256"]
            n_vocab = int(meta["n_vocab"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{src / META_FILENAME}: missing or malformed field ({e})") from e

        ranks_path = src / RANKS_FILENAME
        blob = ranks_path.read_bytes()  # read once: the hash and the parse see the same bytes
        actual_sha = _content_sha256(blob, special_tokens, pat_str)
        if actual_sha != expected_sha:
            raise ValueError(
                f"tokenizer sha256 mismatch in {src}: {META_FILENAME} records {expected_sha} "
                f"but {RANKS_FILENAME} + specials hash to {actual_sha}; the rank file was "
                "modified or corrupted after saving"
            )
        ranks = parse_ranks_file(blob, source=str(ranks_path))
        chat = set(CHAT_TOKENS) <= special_tokens.keys()
        tok = cls(ranks, name=name, kind=kind, pat_str=pat_str, chat=chat)
        # Both are implied by a matching hash of a file we wrote; checked so a hand-edited
        # tokenizer.json fails loudly rather than giving different ids.
        if tok.special_tokens != special_tokens or tok.n_vocab != n_vocab:
            raise ValueError(
                f"{src / META_FILENAME}: special_tokens/n_vocab {special_tokens}/{n_vocab} do "
                f"not match the rank file ({tok.special_tokens}/{tok.n_vocab})"
            )
        return tok


def byte_tokenizer(*, chat: bool = False) -> Tokenizer:
    """The plain byte tokenizer: 256 single-byte ranks, no merges, + 2 specials (258 ids);
    with ``chat``, + the 4 chat tokens (262 ids)."""
    return Tokenizer(byte_ranks(), name="jaxlab-byte", kind="byte", chat=chat)


def bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, *, name: str | None = None, chat: bool = False
) -> Tokenizer:
    """Train BPE on ``texts`` (see ``train_bpe``) and wrap the ranks in a ``Tokenizer``.

    ``vocab_size`` counts every id, the chat tokens included (``chat``): they take the
    place of the last merges. ``n_vocab == vocab_size`` unless the corpus ran out of pairs
    first (then it is smaller).
    """
    n_chat = len(CHAT_TOKENS) if chat else 0
    if chat and vocab_size - n_chat < MIN_VOCAB_SIZE:
        raise ValueError(
            f"tokenizer.vocab_size must be >= {MIN_VOCAB_SIZE + n_chat} with "
            f"tokenizer.chat_tokens = true ({MIN_VOCAB_SIZE} + {n_chat} chat tokens), "
            f"got {vocab_size}"
        )
    ranks = train_bpe(texts, vocab_size - n_chat)
    return Tokenizer(ranks, name=name or f"jaxlab-bpe-{vocab_size}", kind="bpe", chat=chat)
