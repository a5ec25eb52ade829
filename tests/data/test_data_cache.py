"""Token cache: reuse, keys, dtypes, crash safety, the document split, the real tokenizer."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from jaxlab.config.schema import DataConfig, RuntimeConfig
from jaxlab.data import (
    CacheError,
    TokenizerLike,
    TokenStore,
    TrainLoader,
    cache_key,
    default_cache_dir,
    eval_batches,
    is_eval_document,
    iter_documents,
    prepare,
    rich_progress,
)


class StandInTokenizer:
    """UTF-8 bytes as ids (shifted by ``offset``) plus eot/pad as the two last ids.

    Counts ``encode_batch`` calls, and can fail on a given call to simulate a crash.
    """

    def __init__(
        self,
        *,
        n_vocab: int = 258,
        offset: int = 0,
        salt: str = "",
        fail_on_call: int | None = None,
    ) -> None:
        assert offset + 256 <= n_vocab - 2
        self.n_vocab = n_vocab
        self.eot_id = n_vocab - 2
        self.pad_id = n_vocab - 1
        self.offset = offset
        self.sha256 = hashlib.sha256(f"standin:{n_vocab}:{offset}:{salt}".encode()).hexdigest()
        self.fail_on_call = fail_on_call
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls += 1
        if self.fail_on_call is not None and self.calls >= self.fail_on_call:
            raise RuntimeError("simulated crash mid-tokenization")
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if int(i) < self.eot_id)
        return data.decode("utf-8", errors="replace")


def synth(n: int = 200, **kw: object) -> DataConfig:
    return DataConfig(source="synthetic", synthetic_docs=n, **kw)  # type: ignore[arg-type]


def decode_split(store: TokenStore, tok: StandInTokenizer, name: str) -> list[str]:
    s = store.split("train" if name == "train" else "eval")
    return [tok.decode(s.document(i).tolist()) for i in range(s.n_docs)]


def store_dirs(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_second_prepare_skips_tokenizing(tmp_path: Path) -> None:
    tok = StandInTokenizer()
    cfg = synth(300, eval_fraction=0.1)
    seen: list[tuple[int, int | None]] = []
    first = prepare(cfg, tok, tmp_path, progress=lambda d, t: seen.append((d, t)), chunk_bytes=2000)
    assert tok.calls > 1  # chunked
    assert seen[0] == (0, None)  # synthetic: total unknown until the end
    last_done, last_total = seen[-1]
    assert last_total is not None and last_done == last_total > 0
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)

    calls = tok.calls
    second = prepare(cfg, tok, tmp_path)
    assert tok.calls == calls  # no tokenizing on a hit
    assert second.key == first.key and second.path == first.path
    for name in ("train", "eval"):
        np.testing.assert_array_equal(first.split(name).tokens, second.split(name).tokens)
        assert isinstance(second.split(name).tokens, np.memmap)

    meta = json.loads((second.path / "meta.json").read_text())  # type: ignore[operator]
    assert meta["n_docs"] == 300 and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["n_docs"] + meta["splits"]["eval"]["n_docs"] == 300
    assert meta["tokenizer_sha256"] == tok.sha256 and "synthetic" in meta["source"]
    assert {"total_s", "encode_s"} <= set(meta["timings"])
    # Each document is followed by exactly one eot, and the ids are the source text.
    train = second.split("train")
    ends = train.doc_offsets[1:] - 1
    assert np.all(train.tokens[ends] == tok.eot_id)
    assert int((train.tokens == tok.eot_id).sum()) == train.n_docs
    docs = list(iter_documents(cfg))
    assert sorted(decode_split(second, tok, "train") + decode_split(second, tok, "eval")) == sorted(
        docs
    )


def test_key_changes_with_tokenizer_and_source(tmp_path: Path) -> None:
    tok = StandInTokenizer()
    base = synth(50)
    k = cache_key(base, tok)
    assert cache_key(base, StandInTokenizer(salt="retrained")) != k
    assert cache_key(synth(51), tok) != k
    assert cache_key(synth(50, max_bytes=999), tok) != k
    assert cache_key(synth(50, eval_fraction=0.2), tok) != k
    # Packing parameters do not change tokens, so they reuse the cache.
    assert cache_key(synth(50, seq_len=128), tok) == k

    prepare(base, tok, tmp_path)
    other = StandInTokenizer(salt="retrained")
    prepare(base, other, tmp_path)
    assert other.calls > 0
    assert len([d for d in store_dirs(tmp_path) if d.startswith("tokens-")]) == 2


def test_dtype_by_vocab(tmp_path: Path) -> None:
    small = prepare(synth(20), StandInTokenizer(), tmp_path)
    assert small.dtype == np.uint16
    big_tok = StandInTokenizer(n_vocab=70_000, offset=65_600)
    big = prepare(synth(20), big_tok, tmp_path)
    assert big.dtype == np.uint32
    assert int(big.split("train").tokens.max()) == big_tok.eot_id > 65_535
    assert decode_split(big, big_tok, "train") + decode_split(big, big_tok, "eval") != []
    docs = list(iter_documents(synth(20)))
    assert sorted(
        decode_split(big, big_tok, "train") + decode_split(big, big_tok, "eval")
    ) == sorted(docs)


def test_interrupted_write_leaves_nothing_acceptable(tmp_path: Path) -> None:
    cfg = synth(300)
    crashing = StandInTokenizer(fail_on_call=3)  # same sha256 as a healthy stand-in
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare(cfg, crashing, tmp_path, chunk_bytes=2000)
    assert store_dirs(tmp_path) == []  # temp dir cleaned, nothing renamed into place

    healthy = StandInTokenizer()
    store = prepare(cfg, healthy, tmp_path, chunk_bytes=2000)
    assert healthy.calls > 0 and store.n_docs == 300


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    cfg = synth(100)
    tok = StandInTokenizer()
    store = prepare(cfg, tok, tmp_path)
    assert store.path is not None
    good_train = np.array(store.split("train").tokens)
    path = store.path
    del store

    # A process killed before the rename never leaves the final name; simulate worse: a
    # final directory whose token file is truncated, then one without meta.json.
    tokens_file = path / "train.tokens"
    tokens_file.write_bytes(tokens_file.read_bytes()[:-2])
    with pytest.raises(CacheError, match="truncated"):
        TokenStore.open(path)
    calls = tok.calls
    rebuilt = prepare(cfg, tok, tmp_path)
    assert tok.calls > calls
    np.testing.assert_array_equal(rebuilt.split("train").tokens, good_train)

    (path / "meta.json").unlink()
    with pytest.raises(CacheError):
        TokenStore.open(path)
    calls = tok.calls
    prepare(cfg, tok, tmp_path)
    assert tok.calls > calls

    # A stray temp directory from a killed run is ignored.
    shutil.copytree(path, tmp_path / ".tmp-stale")
    calls = tok.calls
    prepare(cfg, tok, tmp_path)
    assert tok.calls == calls


@pytest.mark.parametrize(
    ("n_docs", "eval_fraction", "want_eval"),
    [(3, 0.001, 1), (3, 0.999, 2), (40, 0.0, 0), (1, 0.5, 0)],
)
def test_split_is_by_document_and_non_empty(
    tmp_path: Path, n_docs: int, eval_fraction: float, want_eval: int
) -> None:
    tok = StandInTokenizer()
    store = prepare(synth(n_docs, eval_fraction=eval_fraction), tok, tmp_path, chunk_bytes=1)
    assert store.split("eval").n_docs == want_eval
    assert store.split("train").n_docs == n_docs - want_eval


def test_split_follows_hash_rule_and_is_chunking_independent(tmp_path: Path) -> None:
    cfg = synth(400, eval_fraction=0.2)
    tok = StandInTokenizer()
    store = prepare(cfg, tok, tmp_path / "a", chunk_bytes=1500)
    docs = list(iter_documents(cfg))
    want_eval = [d for i, d in enumerate(docs) if is_eval_document(i, 0.2)]
    want_train = [d for i, d in enumerate(docs) if not is_eval_document(i, 0.2)]
    assert 40 < len(want_eval) < 120
    assert decode_split(store, tok, "eval") == want_eval
    assert decode_split(store, tok, "train") == want_train
    one_chunk = prepare(cfg, tok, tmp_path / "b", chunk_bytes=10**9)
    for name in ("train", "eval"):
        np.testing.assert_array_equal(store.split(name).tokens, one_chunk.split(name).tokens)
        np.testing.assert_array_equal(
            store.split(name).doc_offsets, one_chunk.split(name).doc_offsets
        )


def test_empty_source_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    cfg = DataConfig(source="jsonl", paths=[str(path)])
    with pytest.raises(ValueError, match="no documents"):
        prepare(cfg, StandInTokenizer(), tmp_path / "cache")
    assert store_dirs(tmp_path / "cache") == []


def test_default_cache_dir() -> None:
    runtime = RuntimeConfig(artifacts_dir="arts")
    assert default_cache_dir(DataConfig(), runtime) == Path("arts/cache")
    assert default_cache_dir(DataConfig(cache_dir="/x/y"), runtime) == Path("/x/y")


def test_rich_progress_callback(tmp_path: Path) -> None:
    out = io.StringIO()
    with rich_progress("tokenizing", console=Console(file=out, force_terminal=False)) as cb:
        prepare(synth(50), StandInTokenizer(), tmp_path, progress=cb)
    assert "tokenizing" in out.getvalue()


# ---------------------------------------------------------------------------------------
# The real tokenizer
# ---------------------------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a real tokenizer, counting encode_batch calls."""

    def __init__(self, inner: TokenizerLike) -> None:
        self.inner = inner
        self.n_vocab, self.eot_id, self.pad_id = inner.n_vocab, inner.eot_id, inner.pad_id
        self.sha256 = inner.sha256
        self.calls = 0

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls += 1
        return self.inner.encode_batch(texts)


def test_real_byte_tokenizer_end_to_end(tmp_path: Path) -> None:
    # Imported here so a broken tokenizer package fails this test only; the annotation makes
    # pyright check that the real Tokenizer satisfies the data package's protocol.
    from jaxlab.tokenizer import byte_tokenizer

    real: TokenizerLike = byte_tokenizer()
    counting = CountingTokenizer(real)
    cfg = DataConfig(source="synthetic", synthetic_docs=300, seq_len=32, eval_fraction=0.1)
    store = prepare(cfg, counting, tmp_path)
    assert counting.calls > 0 and store.dtype == np.uint16
    assert (store.eot_id, store.pad_id, store.n_vocab) == (256, 257, 258)
    prepare(cfg, CountingTokenizer(real), tmp_path)  # hit: same key
    again = CountingTokenizer(real)
    prepare(cfg, again, tmp_path)
    assert again.calls == 0

    docs = list(iter_documents(cfg))
    train = store.split("train")
    assert byte_tokenizer().decode(train.document(0)[:-1].tolist()) in docs

    loader = TrainLoader(store, cfg.seq_len, global_batch=4, seed=0)
    batch = loader.batch(0)
    row = batch["tokens"][0]
    mask = batch["loss_mask"][0]
    assert np.all((mask == 0) == (row == real.eot_id))
    text = byte_tokenizer().decode(row[row != real.eot_id].tolist())
    assert any(kind in text for kind in ("count", "sum", "abc", "copy", "say", "down"))

    ev = list(eval_batches(store, cfg.seq_len, 4))
    assert ev and ev[0]["tokens"].shape == (4, 32)
