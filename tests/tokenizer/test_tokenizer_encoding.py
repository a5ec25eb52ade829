"""Tests for ``Tokenizer`` (tiktoken-backed encode/decode, specials, save/load)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import tiktoken.load
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.tokenizer import (
    ENDOFTEXT,
    META_FILENAME,
    PAD,
    RANKS_FILENAME,
    Tokenizer,
    bpe_tokenizer,
    byte_tokenizer,
)

VOCAB = 1000


def _small_corpus() -> list[str]:
    """~200 KB of stdlib source plus some prose, so words and spaces both get merges."""
    texts: list[str] = [
        "The quick brown fox jumps over the lazy dog. " * 50,
        "Über naïve café façade — déjà vu. 日本語のテキスト。 " * 20,
    ]
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= 200_000:
            break
    return texts


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _small_corpus()


@pytest.fixture(scope="module")
def bpe(corpus: list[str]) -> Tokenizer:
    return bpe_tokenizer(corpus, VOCAB)


@pytest.fixture(scope="module", params=["byte", "bpe"])
def tok(request: pytest.FixtureRequest, bpe: Tokenizer) -> Tokenizer:
    return byte_tokenizer() if request.param == "byte" else bpe


# Arbitrary text: st.text() excludes surrogates (they are not encodable as UTF-8), plus a
# strategy biased to emoji (incl. ZWJ sequences), combining marks, and CJK.
_TRICKY = st.text(
    alphabet=st.sampled_from(
        [
            *"a e\n\t'sé",
            "\u0301",
            "\u0308",
            "\u200d",
            "\ufe0f",
            "👍",
            "👩",
            "🏽",
            "日",
            "\U0010fffd",
        ]
    ),
    max_size=60,
)
_ANY_TEXT = st.one_of(st.text(), _TRICKY)


# -- construction ---------------------------------------------------------------------------


def test_byte_tokenizer_shape() -> None:
    t = byte_tokenizer()
    assert t.kind == "byte"
    assert t.n_vocab == 258
    assert (t.eot_id, t.pad_id) == (256, 257)
    assert t.encode("hi") == [ord("h"), ord("i")]
    assert t.encode("é") == list("é".encode())


def test_bpe_tokenizer_shape(bpe: Tokenizer) -> None:
    assert bpe.kind == "bpe"
    assert bpe.n_vocab == VOCAB
    assert (bpe.eot_id, bpe.pad_id) == (VOCAB - 2, VOCAB - 1)
    assert bpe.name == f"jaxlab-bpe-{VOCAB}"
    assert len(bpe.encode(" the quick brown fox")) < len(" the quick brown fox")


def test_bpe_stops_early_on_tiny_corpus() -> None:
    t = bpe_tokenizer(["ab ab ab"], 1000)
    assert t.n_vocab == 260  # 256 bytes + "ab" + " ab" + 2 specials
    assert (t.eot_id, t.pad_id) == (258, 259)


def test_rejects_bad_ranks() -> None:
    with pytest.raises(ValueError, match="single byte"):
        Tokenizer({bytes([b]): 255 - b for b in range(256)}, name="x", kind="byte")
    with pytest.raises(ValueError, match=r"0\.\.n-1"):
        Tokenizer({bytes([b]): b for b in range(255)} | {b"\xff": 300}, name="x", kind="byte")


# -- round trips ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(text=_ANY_TEXT)
def test_roundtrip_arbitrary_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.n_vocab for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


def test_byte_fallback_for_unseen_characters(bpe: Tokenizer) -> None:
    text = "\U0001f9ec𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⁂ \U0010fffd ꙮ \x00\x7f"
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.n_vocab for i in ids)
    assert bpe.decode(ids) == text


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = ["hello world", "", "<|endoftext|> x", "ünïcödé 👍", "def f(x):\n    return x\n"] * 5
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_decode_bytes_streams_partial_utf8(tok: Tokenizer) -> None:
    text = "a👍é日"
    ids = tok.encode(text)
    # Concatenating per-token bytes reconstructs the text even though single tokens (for the
    # byte tokenizer: single bytes) are not valid UTF-8 on their own.
    assert b"".join(tok.decode_bytes([i]) for i in ids) == text.encode("utf-8")


def test_decode_of_partial_char_is_lossy_but_decode_bytes_is_not() -> None:
    t = byte_tokenizer()
    first = t.encode("👍")[:1]  # one byte of a 4-byte UTF-8 sequence
    assert t.decode_bytes(first) == "👍".encode()[:1]
    assert t.decode(first) == "\ufffd"


def test_decode_rejects_out_of_range_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.n_vocab])
    with pytest.raises(ValueError, match="out of range"):
        tok.decode_bytes([-1])


# -- special tokens -----------------------------------------------------------------------------


def test_specials_ids_and_decoding(tok: Tokenizer) -> None:
    n_ranks = tok.n_vocab - 2
    assert tok.special_tokens == {ENDOFTEXT: n_ranks, PAD: n_ranks + 1}
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    assert tok.decode([tok.pad_id]) == "<|pad|>"
    assert tok.decode([*tok.encode("a"), tok.eot_id, *tok.encode("b")]) == "a<|endoftext|>b"


@pytest.mark.parametrize("text", ["<|endoftext|>", "doc one<|endoftext|>doc two", "x <|pad|> y"])
def test_special_strings_in_user_text_are_ordinary(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.eot_id not in ids
    assert tok.pad_id not in ids
    assert tok.decode(ids) == text
    assert tok.encode_batch([text]) == [ids]


# -- save / load --------------------------------------------------------------------------------


def test_save_load_roundtrip(tok: Tokenizer, corpus: list[str], tmp_path: Path) -> None:
    out = tok.save(tmp_path / "tok")
    assert out == tmp_path / "tok"
    loaded = Tokenizer.load(out)
    assert loaded.sha256 == tok.sha256
    assert (loaded.name, loaded.kind, loaded.n_vocab) == (tok.name, tok.kind, tok.n_vocab)
    assert (loaded.eot_id, loaded.pad_id) == (tok.eot_id, tok.pad_id)
    sample = "".join(corpus[:3]) + " <|endoftext|> 👍"
    assert loaded.encode(sample) == tok.encode(sample)
    meta = json.loads((out / META_FILENAME).read_text())
    assert meta["sha256"] == tok.sha256
    assert meta["special_tokens"] == {ENDOFTEXT: tok.eot_id, PAD: tok.pad_id}
    assert meta["n_vocab"] == tok.n_vocab


def test_sha256_is_stable_and_content_addressed(bpe: Tokenizer) -> None:
    assert byte_tokenizer().sha256 == byte_tokenizer().sha256
    assert bpe.sha256 != byte_tokenizer().sha256
    assert len(bpe.sha256) == 64 and int(bpe.sha256, 16) >= 0
    # Same ranks, different name: same ids for every text, so the same hash.
    assert Tokenizer(bpe.mergeable_ranks, name="other", kind="bpe").sha256 == bpe.sha256


def test_rank_file_is_tiktoken_format(
    bpe: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bpe.save(tmp_path)
    # An empty cache dir disables tiktoken's read cache (see encoding.parse_ranks_file).
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert tiktoken.load.load_tiktoken_bpe(str(tmp_path / RANKS_FILENAME)) == bpe.mergeable_ranks


def test_tampered_rank_file_fails_load(bpe: Tokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    path = tmp_path / RANKS_FILENAME
    lines = path.read_bytes().splitlines(keepends=True)
    # Swap the ranks of two learned tokens: still a well-formed file, different encodings.
    a, b = lines[300].split(), lines[301].split()
    lines[300] = a[0] + b" " + b[1] + b"\n"
    lines[301] = b[0] + b" " + a[1] + b"\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(ValueError, match=r"sha256 mismatch.*modified or corrupted"):
        Tokenizer.load(tmp_path)


def test_tampered_specials_fail_load(bpe: Tokenizer, tmp_path: Path) -> None:
    bpe.save(tmp_path)
    meta_path = tmp_path / META_FILENAME
    meta = json.loads(meta_path.read_text())
    meta["special_tokens"] = {ENDOFTEXT: bpe.pad_id, PAD: bpe.eot_id}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        Tokenizer.load(tmp_path)


def test_resave_same_path_loads_new_content(bpe: Tokenizer, tmp_path: Path) -> None:
    # Guards against tiktoken's path-keyed read cache serving a previous file's ranks.
    bpe.save(tmp_path)
    assert Tokenizer.load(tmp_path).sha256 == bpe.sha256
    byte_tokenizer().save(tmp_path)
    assert Tokenizer.load(tmp_path).sha256 == byte_tokenizer().sha256
