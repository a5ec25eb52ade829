"""Document sources: synthetic, text globs, jsonl, stdlib, max_bytes and fingerprints."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxlab.config.schema import DataConfig
from jaxlab.data import (
    describe_source,
    estimate_total_bytes,
    iter_documents,
    resolve_files,
    source_fingerprint,
    stdlib_files,
    synthetic_document,
)
from jaxlab.data.sources import STDLIB_SKIP_DIRS, stdlib_root

# ---------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_prefix_stable() -> None:
    cfg = DataConfig(source="synthetic", synthetic_docs=50)
    docs = list(iter_documents(cfg))
    assert len(docs) == 50
    assert docs == list(iter_documents(cfg))
    assert list(iter_documents(DataConfig(source="synthetic", synthetic_docs=20))) == docs[:20]
    assert len(set(docs)) == 50
    assert source_fingerprint(cfg) == source_fingerprint(cfg.model_copy())
    assert source_fingerprint(cfg) != source_fingerprint(
        cfg.model_copy(update={"synthetic_docs": 51})
    )


def test_synthetic_golden_document() -> None:
    # Bump SYNTHETIC_VERSION (it is in the cache key) when changing the generator.
    assert synthetic_document(0) == (
        "sum: 1+7=8 18+2=20 14+9=23\nsum: 3+0=3 18+20=38\nabc: q r s t u v w x y z a b c\n"
        "sum: 20+9=29 8+7=15 3+0=3\nabc: i j k l m n o\n"
    )


def test_synthetic_patterns_are_consistent() -> None:
    kinds: set[str] = set()
    for i in range(300):
        for line in synthetic_document(i).splitlines():
            kind, _, body = line.partition(": ")
            kinds.add(kind)
            items = body.split(" ")
            if kind == "count":
                nums = [int(x) for x in items]
                assert nums == list(range(nums[0], nums[0] + len(nums)))
            elif kind == "down":
                nums = [int(x) for x in items]
                assert nums == list(range(nums[0], nums[0] - len(nums), -1))
            elif kind == "sum":
                for eq in items:
                    a, b, c = map(int, re.split(r"[+=]", eq))
                    assert a + b == c
            elif kind == "copy":
                assert len(set(items)) == 1 and len(items) >= 2
            elif kind == "abc":
                letters = [ord(x) - ord("a") for x in items]
                assert all((b - a) % 26 == 1 for a, b in itertools.pairwise(letters))
    assert kinds == {"count", "down", "sum", "copy", "abc", "say"}


# ---------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "sub" / "c.txt").write_text("sea")
    (tmp_path / "bad.txt").write_bytes(b"ok\xff\xfeok")
    (tmp_path / "notes.md").write_text("md")
    return tmp_path


def test_text_glob_sorted_and_recursive(text_dir: Path) -> None:
    cfg = DataConfig(source="text", paths=[str(text_dir / "*.txt")])
    assert list(iter_documents(cfg)) == ["ay", "bee", "ok\ufffd\ufffdok"]
    cfg = DataConfig(source="text", paths=[str(text_dir / "**" / "*.txt")])
    assert [p.name for p in resolve_files(cfg)] == ["a.txt", "b.txt", "bad.txt", "c.txt"]
    # Patterns in the given order; a file matched twice is read once.
    cfg = DataConfig(
        source="text",
        paths=[str(text_dir / "notes.md"), str(text_dir / "*"), str(text_dir / "a.txt")],
    )
    assert list(iter_documents(cfg)) == ["md", "ay", "bee", "ok\ufffd\ufffdok"]


def test_text_errors_name_the_setting(text_dir: Path) -> None:
    missing = str(text_dir / "*.nope")
    with pytest.raises(ValueError, match=r"data\.paths.*\*\.nope.*matched no files"):
        list(iter_documents(DataConfig(source="text", paths=[missing])))
    with pytest.raises(ValueError, match=r"data\.paths.*does not exist"):
        list(iter_documents(DataConfig(source="text", paths=[str(text_dir / "x.txt")])))
    with pytest.raises(ValueError, match=r"data\.paths.*directory"):
        list(iter_documents(DataConfig(source="text", paths=[str(text_dir)])))
    with pytest.raises(ValueError, match=r"data\.paths"):
        source_fingerprint(DataConfig(source="text", paths=[]))


def test_text_fingerprint_tracks_files(text_dir: Path) -> None:
    cfg = DataConfig(source="text", paths=[str(text_dir / "*.txt")])
    fp = source_fingerprint(cfg)
    assert fp == source_fingerprint(cfg)
    st_a = (text_dir / "a.txt").stat()
    os.utime(text_dir / "a.txt", ns=(st_a.st_atime_ns, st_a.st_mtime_ns + 10**9))
    fp_touched = source_fingerprint(cfg)
    assert fp_touched != fp
    (text_dir / "new.txt").write_text("new")
    assert source_fingerprint(cfg) != fp_touched
    assert source_fingerprint(cfg.model_copy(update={"max_bytes": 3})) != source_fingerprint(cfg)
    assert estimate_total_bytes(cfg) == sum(p.stat().st_size for p in resolve_files(cfg))
    assert "text" in describe_source(cfg)


# ---------------------------------------------------------------------------------------
# max_bytes
# ---------------------------------------------------------------------------------------

_MULTIBYTE_DOCS = ["héllo wörld ", "日本語のテキスト", "plain ascii", "🙂🙃 emoji"]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cap=st.integers(1, 80))
def test_max_bytes_truncates_at_a_character_boundary(tmp_path: Path, cap: int) -> None:
    for i, doc in enumerate(_MULTIBYTE_DOCS):  # same content every example: idempotent
        (tmp_path / f"{i}.txt").write_text(doc, encoding="utf-8")
    full = "".join(_MULTIBYTE_DOCS).encode()
    cfg = DataConfig(source="text", paths=[str(tmp_path / "*.txt")], max_bytes=cap)
    docs = list(iter_documents(cfg))
    got = "".join(docs).encode()
    assert len(got) <= cap
    assert full.startswith(got)
    assert len(got) > cap - 4 or len(got) == len(full)  # only a partial char is dropped
    # Reading stops after the capped document.
    assert len(docs) <= len(_MULTIBYTE_DOCS)
    syn = list(iter_documents(DataConfig(source="synthetic", synthetic_docs=10, max_bytes=cap)))
    assert sum(len(d.encode()) for d in syn) == cap  # ASCII: exact


# ---------------------------------------------------------------------------------------
# jsonl
# ---------------------------------------------------------------------------------------


def test_jsonl_field_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"body": "first", "id": 1}, {"body": "sécond"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    cfg = DataConfig(source="jsonl", paths=[str(path)], jsonl_text_field="body")
    assert list(iter_documents(cfg)) == ["first", "sécond"]
    assert source_fingerprint(cfg) != source_fingerprint(
        cfg.model_copy(update={"jsonl_text_field": "text"})
    )


@pytest.mark.parametrize(
    ("bad_line", "pattern"),
    [
        ('{"other": "x"}', r"d\.jsonl:2: no field 'text' \(data\.jsonl_text_field\)"),
        ("{not json", r"d\.jsonl:2: invalid JSON"),
        ('["a list"]', r"d\.jsonl:2: expected a JSON object"),
        ('{"text": 3}', r"d\.jsonl:2: field 'text' .* must be a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, bad_line: str, pattern: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n' + bad_line + "\n", encoding="utf-8")
    docs = iter_documents(DataConfig(source="jsonl", paths=[str(path)]))
    assert next(docs) == "ok"
    with pytest.raises(ValueError, match=pattern):
        next(docs)


# ---------------------------------------------------------------------------------------
# stdlib
# ---------------------------------------------------------------------------------------


def test_stdlib_files_rule() -> None:
    files = stdlib_files()
    root = stdlib_root()
    rel = [p.relative_to(root).as_posix() for p in files]
    assert rel == sorted(rel)
    assert len(files) > 100 and all(r.endswith(".py") for r in rel)
    assert not any(set(Path(r).parts) & STDLIB_SKIP_DIRS for r in rel)
    assert "os.py" in rel and "json/__init__.py" in rel


def test_stdlib_capped_source() -> None:
    cfg = DataConfig(source="stdlib", max_bytes=60_000)
    docs = list(iter_documents(cfg))
    assert 60_000 - 3 <= sum(len(d.encode()) for d in docs) <= 60_000  # cut at a char boundary
    first = stdlib_files()[0].read_bytes().decode("utf-8", errors="replace")
    assert docs[0] == first[: len(docs[0])]
    assert docs == list(iter_documents(cfg))
    fp = source_fingerprint(cfg)
    assert fp == source_fingerprint(cfg)
    assert fp != source_fingerprint(cfg.model_copy(update={"max_bytes": 60_001}))
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in describe_source(cfg)
    assert estimate_total_bytes(cfg) == 60_000
