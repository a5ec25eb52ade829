"""Suite ``tokenizer``: BPE training and encoding throughput on Python's own stdlib source.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site- and
dist-packages excluded), sorted by relative path, concatenated until
``tokenizer.train_bytes`` bytes (512 kB with --quick; a file that crosses the limit is cut).
Its size is in the case and its SHA-256 in ``derived``: two runs on different Python builds
read different bytes and are not comparable.

Cases: ``bpe_train`` (``bpe_tokenizer(texts, tokenizer.vocab_size)``), ``encode_batch``
(tiktoken's thread pool over the files) and ``encode`` (one thread, file by file).
``MB/s = corpus bytes / 1e6 / median time``.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxlab.bench.context import BenchContext
from jaxlab.bench.record import Record
from jaxlab.bench.stats import Stats
from jaxlab.bench.suites import suite
from jaxlab.bench.timing import no_sync

QUICK_BYTES = 512_000
ENCODE_THREADS = 8
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_corpus(max_bytes: int) -> tuple[list[str], int, str]:
    """``(texts, total UTF-8 bytes, sha256 hex)`` of the stdlib corpus up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    texts: list[str] = []
    total = 0
    digest = hashlib.sha256()
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[: max_bytes - total]
        text = data.decode("utf-8", errors="ignore")  # a cut may split a character
        raw = text.encode("utf-8")
        texts.append(text)
        total += len(raw)
        digest.update(raw)
    if not texts:
        raise RuntimeError(f"no *.py files under {root}: cannot build the stdlib corpus")
    return texts, total, digest.hexdigest()


@suite("tokenizer", description="BPE train and encode MB/s on the Python stdlib source")
def tokenizer_suite(ctx: BenchContext) -> Iterator[Record]:
    from jaxlab.tokenizer import Tokenizer, bpe_tokenizer

    cfg = ctx.config.tokenizer
    max_bytes = min(cfg.train_bytes, QUICK_BYTES) if ctx.quick else cfg.train_bytes
    vocab = cfg.vocab_size
    ctx.status(f"reading the stdlib corpus ({max_bytes} bytes)")
    texts, nbytes, sha = stdlib_corpus(max_bytes)
    corpus = {"corpus_sha256": sha, "corpus_files": len(texts)}

    def mb_per_s(s: Stats) -> dict[str, Any]:
        return {"mb_per_s": nbytes / 1e6 / s.median_value, **corpus}

    trained: list[Tokenizer] = []

    def train() -> Tokenizer:
        tok = bpe_tokenizer(texts, vocab)
        trained[:] = [tok]
        return tok

    case = {"op": "bpe_train", "bytes": nbytes, "vocab_size": vocab}
    yield ctx.bench("bpe_train_time", train, case=case, sync=no_sync, derive=mb_per_s)

    enc_case = {"bytes": nbytes, "vocab_size": vocab}
    try:
        tok = trained[0] if trained else train()
        n_tokens = sum(len(ids) for ids in tok.encode_batch(texts, num_threads=ENCODE_THREADS))
    except Exception as e:
        yield ctx.failure("encode_time", e, case={"op": "encode_batch", **enc_case})
        return

    def with_tokens(s: Stats) -> dict[str, Any]:
        return {**mb_per_s(s), "tokens": n_tokens, "tokens_per_s": n_tokens / s.median_value}

    yield ctx.bench(
        "encode_time",
        lambda: tok.encode_batch(texts, num_threads=ENCODE_THREADS),
        case={"op": "encode_batch", "threads": ENCODE_THREADS, **enc_case},
        sync=no_sync,
        derive=with_tokens,
    )
    yield ctx.bench(
        "encode_time",
        lambda: [tok.encode(t) for t in texts],
        case={"op": "encode", "threads": 1, **enc_case},
        sync=no_sync,
        derive=with_tokens,
    )
