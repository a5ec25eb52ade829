"""``prepare``: tokenize a source once into an on-disk :class:`TokenStore`, then reuse it.

The cache key hashes everything that changes the stored tokens: the source fingerprint
(kind, parameters, file paths/sizes/mtimes, ``max_bytes``), the tokenizer's sha256 and
``n_vocab``, the eval fraction and the split salt. ``seq_len`` and batch settings are *not*
in it: packing happens at load time, so changing them reuses the cache.

Writing is streaming and crash-safe:

- documents are tokenized in chunks (``encode_batch`` on about ``chunk_bytes`` of text) and
  each chunk is appended to the split files straight away, so peak memory is one chunk, not
  the corpus (one document must still fit in memory);
- everything is written into a fresh temporary directory and ``meta.json`` comes last; the
  directory is then renamed onto its final name in one atomic ``os.replace``. A reader only
  accepts a directory whose meta.json parses and whose file sizes match it, so a crash at
  any point leaves nothing a later ``prepare`` would accept (a killed process can leave a
  ``.tmp-*`` directory behind; it is never read and is safe to delete).

Train/eval split is by document: document ``i`` goes to eval iff
``blake2b(salt, i) / 2**64 < eval_fraction``; a deterministic, order-only rule, so no
document has tokens in both splits. If that leaves a split empty and there are at least two
documents (and ``eval_fraction > 0``), the *last* document is moved into the empty split;
this is why the last document of each chunk is held back until the next chunk arrives.

A ``chat-jsonl`` source is rendered with the chat template instead of encoded as text, and
its store also holds each split's target mask (``{split}.mask``: 1 on the assistant's
tokens, 0 elsewhere and on every eot), which the loader turns into the loss mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import numpy as np

from jaxlab.config.schema import DataConfig, RuntimeConfig
from jaxlab.data.protocol import TokenizerLike
from jaxlab.data.sources import (
    conversation_bytes,
    describe_source,
    estimate_total_bytes,
    iter_conversations,
    iter_documents,
    source_fingerprint,
)
from jaxlab.data.store import (
    CACHE_FORMAT_VERSION,
    META_FILENAME,
    SPLITS,
    CacheError,
    SplitName,
    TokenStore,
    mask_filename,
    offsets_filename,
    token_dtype,
    tokens_filename,
)

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int | None], None]

SPLIT_SALT = "jaxlab-split-v1"
DEFAULT_CHUNK_BYTES = 1 << 20
_MAX_CHUNK_DOCS = 8192  # bounds the Python lists per chunk when documents are tiny


def default_cache_dir(data: DataConfig, runtime: RuntimeConfig) -> Path:
    """``data.cache_dir`` if set, else ``<runtime.artifacts_dir>/cache``."""
    return Path(data.cache_dir) if data.cache_dir else Path(runtime.artifacts_dir) / "cache"


def cache_key(cfg: DataConfig, tokenizer: TokenizerLike, *, fingerprint: str | None = None) -> str:
    """Hex SHA-256 naming the tokens ``prepare(cfg, tokenizer, ...)`` would write."""
    info = {
        "format_version": CACHE_FORMAT_VERSION,
        "source": fingerprint or source_fingerprint(cfg),
        "tokenizer_sha256": tokenizer.sha256,
        "n_vocab": tokenizer.n_vocab,
        "eot_id": tokenizer.eot_id,
        "eval_fraction": cfg.eval_fraction,
        "split_salt": SPLIT_SALT,
    }
    blob = json.dumps(info, sort_keys=True, ensure_ascii=True).encode("ascii")
    return hashlib.sha256(blob).hexdigest()


def store_dirname(key: str) -> str:
    return f"tokens-{key[:16]}"


def is_eval_document(index: int, eval_fraction: float) -> bool:
    """The split rule before the non-empty fix-up (see module docstring)."""
    if eval_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(f"{SPLIT_SALT}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < eval_fraction


def prepare(
    cfg: DataConfig,
    tokenizer: TokenizerLike,
    cache_dir: Path,
    *,
    progress: ProgressFn | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> TokenStore:
    """Return the token store for ``(cfg, tokenizer)``, tokenizing only on a cache miss.

    ``progress(bytes_done, bytes_total_or_None)`` is called as text is tokenized (UTF-8
    bytes of documents; the total is an estimate, see ``estimate_total_bytes``) and once at
    the end with ``(done, done)``. On a cache hit it is called once with the recorded size.
    """
    cache_dir = Path(cache_dir)
    fingerprint = source_fingerprint(cfg)
    key = cache_key(cfg, tokenizer, fingerprint=fingerprint)
    final = cache_dir / store_dirname(key)
    if final.exists():
        try:
            store = TokenStore.open(final, expected_key=key)
        except CacheError as e:
            log.warning("discarding unusable token cache %s: %s", final, e)
            shutil.rmtree(final, ignore_errors=True)
        else:
            if progress is not None:
                done = int(store.meta.get("bytes_read", 0))
                progress(done, done)
            return store

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{store_dirname(key)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = _write_store(cfg, tokenizer, tmp, key, fingerprint, progress, chunk_bytes)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same key first (the target is a non-empty dir):
            # its result is identical, so use it and drop ours.
            if not final.exists():
                raise
            log.info("token cache %s was written concurrently; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    store = TokenStore.open(final, expected_key=key)
    log.info(
        "tokenized %s: %d docs, %d tokens in %.1fs -> %s",
        meta["source"],
        meta["n_docs"],
        meta["n_tokens"],
        meta["timings"]["total_s"],
        final,
    )
    return store


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


class _SplitWriter:
    """Appends documents to one split's ``.tokens`` and ``.offsets`` files."""

    def __init__(
        self, directory: Path, name: str, dtype: np.dtype[Any], masked: bool = False
    ) -> None:
        self.dtype = dtype
        self.n_tokens = 0
        self.n_docs = 0
        self._tokens: BinaryIO = open(directory / tokens_filename(name), "wb")  # noqa: SIM115
        self._offsets: BinaryIO = open(directory / offsets_filename(name), "wb")  # noqa: SIM115
        self._mask: BinaryIO | None = (
            open(directory / mask_filename(name), "wb") if masked else None  # noqa: SIM115
        )
        np.zeros(1, np.int64).tofile(self._offsets)

    def write(
        self,
        docs: list[list[int]],
        eot_id: int,
        n_vocab: int,
        masks: list[list[int]] | None = None,
    ) -> None:
        if not docs:
            return
        if self._mask is not None:
            assert masks is not None and len(masks) == len(docs)
            flat_mask = np.fromiter(chain.from_iterable(chain(m, (0,)) for m in masks), np.uint8)
            flat_mask.tofile(self._mask)
        lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
        count = int(lengths.sum())
        eot = (eot_id,)
        flat = np.fromiter(chain.from_iterable(chain(d, eot) for d in docs), np.int64, count)
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= n_vocab:
            # Checked before the narrowing cast, which would silently wrap bad ids.
            bad = lo if lo < 0 else hi
            raise ValueError(f"tokenizer produced id {bad}, outside [0, n_vocab={n_vocab})")
        flat.astype(self.dtype).tofile(self._tokens)
        (np.cumsum(lengths) + self.n_tokens).tofile(self._offsets)
        self.n_tokens += count
        self.n_docs += len(docs)

    def close(self) -> None:
        self._tokens.close()
        self._offsets.close()
        if self._mask is not None:
            self._mask.close()


def _text_bytes(doc: str) -> int:
    return len(doc.encode("utf-8"))


D = TypeVar("D")


def _chunks(
    docs: Iterator[D], chunk_bytes: int, size_of: Callable[[Any], int] = _text_bytes
) -> Iterator[tuple[list[D], int]]:
    """Group documents into lists of about ``chunk_bytes`` UTF-8 bytes (>= 1 doc each)."""
    chunk: list[D] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += size_of(doc)
        if size >= chunk_bytes or len(chunk) >= _MAX_CHUNK_DOCS:
            yield chunk, size
            chunk, size = [], 0
    if chunk:
        yield chunk, size


# One chunk of encoded documents: their ids, their target masks (None: the source does
# not mask), and the bytes of text they came from.
Encoded = tuple[list[list[int]], list[list[int]] | None, int]
# One document on its way to a split: (index in the source, ids, target mask or None).
Item = tuple[int, list[int], list[int] | None]


def _encoded_chunks(
    cfg: DataConfig, tokenizer: TokenizerLike, chunk_bytes: int
) -> tuple[Iterator[Encoded], dict[str, float]]:
    """The source's documents, encoded chunk by chunk, and a dict that accumulates the
    seconds spent encoding (``encode_s``)."""
    timing = {"encode_s": 0.0}

    def text() -> Iterator[Encoded]:
        for texts, size in _chunks(iter_documents(cfg), chunk_bytes):
            t0 = time.perf_counter()
            encoded = tokenizer.encode_batch(texts)
            timing["encode_s"] += time.perf_counter() - t0
            if len(encoded) != len(texts):
                raise ValueError(
                    f"tokenizer.encode_batch returned {len(encoded)} results for {len(texts)} texts"
                )
            yield encoded, None, size

    def chat() -> Iterator[Encoded]:
        from jaxlab.tokenizer.chat import ChatTemplate, ChatTokenizer

        template = ChatTemplate(cast(ChatTokenizer, tokenizer))
        for convs, size in _chunks(iter_conversations(cfg), chunk_bytes, conversation_bytes):
            t0 = time.perf_counter()
            rendered = [template.render(c) for c in convs]
            timing["encode_s"] += time.perf_counter() - t0
            yield [r.ids for r in rendered], [r.target_mask() for r in rendered], size

    return (chat() if cfg.source == "chat-jsonl" else text()), timing


def _write_store(
    cfg: DataConfig,
    tokenizer: TokenizerLike,
    directory: Path,
    key: str,
    fingerprint: str,
    progress: ProgressFn | None,
    chunk_bytes: int,
) -> dict[str, Any]:
    t_start = time.perf_counter()
    n_vocab, eot_id = tokenizer.n_vocab, tokenizer.eot_id
    dtype = token_dtype(n_vocab)
    total = estimate_total_bytes(cfg)
    if progress is not None:
        progress(0, total)

    masked = cfg.source == "chat-jsonl"
    writers = {name: _SplitWriter(directory, name, dtype, masked) for name in SPLITS}
    done = 0
    n_docs = 0
    # The last item is held back for the non-empty fix-up.
    pending: Item | None = None

    def write(name: SplitName, items: list[Item]) -> None:
        masks = [m for _, _, m in items if m is not None] if masked else None
        writers[name].write([ids for _, ids, _ in items], eot_id, n_vocab, masks)

    def route(items: list[Item]) -> None:
        by_split: dict[SplitName, list[Item]] = {name: [] for name in SPLITS}
        for item in items:
            name: SplitName = "eval" if is_eval_document(item[0], cfg.eval_fraction) else "train"
            by_split[name].append(item)
        for name, part in by_split.items():
            write(name, part)

    chunks, timing = _encoded_chunks(cfg, tokenizer, chunk_bytes)
    try:
        for encoded, masks, size in chunks:
            indices = range(n_docs, n_docs + len(encoded))
            items: list[Item] = [
                (i, ids, None if masks is None else masks[k])
                for k, (i, ids) in enumerate(zip(indices, encoded, strict=True))
            ]
            n_docs += len(encoded)
            if pending is not None:
                items.insert(0, pending)
            pending = items.pop()
            route(items)
            done += size
            if progress is not None:
                progress(done, total)

        if pending is None:
            raise ValueError(f"data source {describe_source(cfg)} yielded no documents")
        index = pending[0]
        target: SplitName = "eval" if is_eval_document(index, cfg.eval_fraction) else "train"
        if n_docs >= 2 and cfg.eval_fraction > 0:
            if writers["eval"].n_docs == 0:
                target = "eval"
            elif writers["train"].n_docs == 0:
                target = "train"
        write(target, [pending])
    finally:
        for w in writers.values():
            w.close()
    encode_s = timing["encode_s"]

    total_s = time.perf_counter() - t_start
    n_tokens = sum(w.n_tokens for w in writers.values())
    meta: dict[str, Any] = {
        "format_version": CACHE_FORMAT_VERSION,
        "key": key,
        "source": describe_source(cfg),
        "source_fingerprint": fingerprint,
        "tokenizer_sha256": tokenizer.sha256,
        "n_vocab": n_vocab,
        "eot_id": eot_id,
        "pad_id": tokenizer.pad_id,
        "dtype": dtype.name,
        **({"target_mask": True} if masked else {}),
        "eval_fraction": cfg.eval_fraction,
        "split_salt": SPLIT_SALT,
        "n_docs": n_docs,
        "n_tokens": n_tokens,
        "bytes_read": done,
        "splits": {
            name: {"n_docs": w.n_docs, "n_tokens": w.n_tokens} for name, w in writers.items()
        },
        "created_unix": time.time(),
        "timings": {
            "total_s": round(total_s, 4),
            "encode_s": round(encode_s, 4),
            "tokens_per_s": round(n_tokens / total_s, 1) if total_s > 0 else None,
        },
    }
    # meta.json last: its presence (with matching sizes) is what marks the store complete.
    meta_path = directory / META_FILENAME
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    if progress is not None:
        progress(done, done)
    return meta
