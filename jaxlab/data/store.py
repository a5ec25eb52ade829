"""``TokenStore``: the tokenized corpus as two memory-mapped token streams (train, eval).

On disk a store is one directory (written by :func:`jaxlab.data.cache.prepare`)::

    meta.json        counts, dtype, key, source description, timings (written last)
    train.tokens     raw uint16/uint32 ids, every document followed by eot_id
    train.offsets    raw int64, n_docs + 1 entries: document d is tokens[off[d]:off[d+1]]
    eval.tokens      the same for the held-out documents
    eval.offsets
    train.mask       only for sources that mask the loss (``chat-jsonl``; meta.json's
    eval.mask        ``target_mask``): raw uint8, one per token, 1 where that token is a
                     training target (an assistant reply); absent: every token is one

Nothing here tokenizes; this module only opens, validates and views the files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

SplitName = Literal["train", "eval"]
SPLITS: tuple[SplitName, ...] = get_args(SplitName)

CACHE_FORMAT_VERSION = 1
META_FILENAME = "meta.json"
_OFFSET_DTYPE = np.dtype(np.int64)


class CacheError(ValueError):
    """A cache directory is missing, incomplete or does not match what was asked for."""


def token_dtype(n_vocab: int) -> np.dtype[Any]:
    """uint16 when every id fits (``n_vocab <= 65535``), else uint32: half the disk and RAM."""
    if n_vocab < 1:
        raise ValueError(f"n_vocab must be >= 1 (got {n_vocab})")
    if n_vocab > 2**32:
        raise ValueError(f"n_vocab {n_vocab} does not fit uint32 token storage")
    return np.dtype(np.uint16) if n_vocab <= 65535 else np.dtype(np.uint32)


def tokens_filename(split: str) -> str:
    return f"{split}.tokens"


def offsets_filename(split: str) -> str:
    return f"{split}.offsets"


def mask_filename(split: str) -> str:
    return f"{split}.mask"


@dataclass(frozen=True)
class TokenSplit:
    """One split's token stream and document offsets (both 1-D, usually memmaps), and for
    sources that mask the loss, which tokens are training targets (uint8, like ``tokens``;
    None: all of them)."""

    name: str
    tokens: np.ndarray
    doc_offsets: np.ndarray
    target_mask: np.ndarray | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.doc_offsets.shape[0]) - 1

    def document(self, index: int) -> np.ndarray:
        """Token ids of document ``index``, including its trailing eot."""
        if not 0 <= index < self.n_docs:
            raise IndexError(f"document {index} out of range for {self.n_docs} docs")
        return self.tokens[int(self.doc_offsets[index]) : int(self.doc_offsets[index + 1])]


def _map(path: Path, dtype: np.dtype[Any], count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype=dtype)  # numpy cannot mmap an empty file
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TokenStore:
    """A tokenized corpus: ``split("train")`` and ``split("eval")`` plus tokenizer ids."""

    def __init__(
        self,
        splits: Mapping[str, TokenSplit],
        *,
        n_vocab: int,
        eot_id: int,
        pad_id: int,
        meta: Mapping[str, Any] | None = None,
        path: Path | None = None,
    ) -> None:
        missing = [s for s in SPLITS if s not in splits]
        if missing:
            raise ValueError(f"TokenStore needs splits {SPLITS}, missing {missing}")
        self._splits = dict(splits)
        self.n_vocab = n_vocab
        self.eot_id = eot_id
        self.pad_id = pad_id
        self.meta: dict[str, Any] = dict(meta or {})
        self.path = path

    def split(self, name: SplitName) -> TokenSplit:
        if name not in self._splits:
            raise KeyError(f"unknown split {name!r}; expected one of {SPLITS}")
        return self._splits[name]

    @property
    def key(self) -> str | None:
        """The cache key this store was built under (``None`` for in-memory stores)."""
        return self.meta.get("key")

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._splits["train"].tokens.dtype

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self._splits.values())

    @property
    def n_docs(self) -> int:
        return sum(s.n_docs for s in self._splits.values())

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}={s.n_docs} docs/{s.n_tokens} tokens" for n, s in self._splits.items()
        )
        return f"TokenStore({parts}, dtype={self.dtype}, path={self.path})"

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, *, expected_key: str | None = None) -> TokenStore:
        """Open a store directory, checking it is complete; raise :class:`CacheError` if not.

        The checks are cheap (file sizes against the counts in meta.json, first/last
        offsets) but catch a partially written or truncated cache.
        """
        meta_path = path / META_FILENAME
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CacheError(f"{meta_path}: unreadable ({e})") from e
        try:
            if meta["format_version"] != CACHE_FORMAT_VERSION:
                raise CacheError(
                    f"{meta_path}: format_version {meta['format_version']} != "
                    f"{CACHE_FORMAT_VERSION}"
                )
            if expected_key is not None and meta["key"] != expected_key:
                raise CacheError(f"{meta_path}: key {meta['key']} != expected {expected_key}")
            dtype = np.dtype(meta["dtype"])
            if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
                raise CacheError(f"{meta_path}: unsupported dtype {dtype}")
            splits: dict[str, TokenSplit] = {}
            masked = bool(meta.get("target_mask", False))
            for name in SPLITS:
                info = meta["splits"][name]
                splits[name] = _open_split(
                    path, name, dtype, info["n_tokens"], info["n_docs"], masked
                )
            return cls(
                splits,
                n_vocab=int(meta["n_vocab"]),
                eot_id=int(meta["eot_id"]),
                pad_id=int(meta["pad_id"]),
                meta=meta,
                path=path,
            )
        except (KeyError, TypeError) as e:
            raise CacheError(f"{meta_path}: missing or malformed field ({e!r})") from e

    @classmethod
    def from_documents(
        cls,
        train_docs: Iterable[Sequence[int]],
        eval_docs: Iterable[Sequence[int]] = (),
        *,
        n_vocab: int,
        eot_id: int,
        pad_id: int,
        target_masks: tuple[Iterable[Sequence[int]], Iterable[Sequence[int]]] | None = None,
    ) -> TokenStore:
        """An in-memory store from token-id documents (eot is appended to each); for tests
        and small experiments that do not want a cache directory. ``target_masks``: per
        split, one 0/1 list per document (its eot gets 0), as a masking source writes."""
        dtype = token_dtype(n_vocab)
        splits: dict[str, TokenSplit] = {}
        for k, (name, docs) in enumerate((("train", train_docs), ("eval", eval_docs))):
            docs = [[*d, eot_id] for d in docs]
            mask = None
            if target_masks is not None:
                mask = np.array([t for m in target_masks[k] for t in (*m, 0)], dtype=np.uint8)
            lengths = np.array([len(d) for d in docs], dtype=_OFFSET_DTYPE)
            offsets = np.concatenate([np.zeros(1, _OFFSET_DTYPE), np.cumsum(lengths)])
            flat = np.array([t for d in docs for t in d], dtype=np.int64)
            if flat.size and (flat.min() < 0 or flat.max() >= n_vocab):
                raise ValueError(f"token ids must be in [0, {n_vocab})")
            if mask is not None and mask.shape != flat.shape:
                raise ValueError(f"{name}: target mask of {mask.size} for {flat.size} tokens")
            splits[name] = TokenSplit(name, flat.astype(dtype), offsets.astype(_OFFSET_DTYPE), mask)
        return cls(splits, n_vocab=n_vocab, eot_id=eot_id, pad_id=pad_id)


def _open_split(
    path: Path, name: str, dtype: np.dtype[Any], n_tokens: int, n_docs: int, masked: bool
) -> TokenSplit:
    tok_path, off_path = path / tokens_filename(name), path / offsets_filename(name)
    mask_path = path / mask_filename(name)
    sizes = [(tok_path, n_tokens * dtype.itemsize), (off_path, (n_docs + 1) * 8)]
    if masked:
        sizes.append((mask_path, n_tokens))
    for p, want in sizes:
        try:
            size = p.stat().st_size
        except OSError as e:
            raise CacheError(f"{p}: missing ({e})") from e
        if size != want:
            raise CacheError(f"{p}: {size} bytes, meta.json implies {want} (truncated?)")
    offsets = _map(off_path, _OFFSET_DTYPE, n_docs + 1)
    if int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens:
        raise CacheError(f"{off_path}: offsets do not span 0..{n_tokens}")
    mask = _map(mask_path, np.dtype(np.uint8), n_tokens) if masked else None
    return TokenSplit(name, _map(tok_path, dtype, n_tokens), offsets, mask)
