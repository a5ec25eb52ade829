"""Document sources: turn a :class:`DataConfig` into a deterministic stream of strings.

Five kinds (``cfg.source``):

``synthetic``
    ``cfg.synthetic_docs`` short documents of learnable patterns (counting, countdowns,
    alphabet runs, small sums, copies, repeated phrases). Document ``i`` is drawn from its
    own tiny PRNG seeded by a fixed constant and ``i`` alone, so the corpus is identical on
    every machine and Python/numpy version, and asking for more documents only appends.
``text``
    Every file matched by ``cfg.paths`` (literal paths or globs; ``**`` recurses), one
    document per file. Each pattern's matches are sorted; patterns are taken in the order
    given and a file matched twice is read once. Bytes that are not UTF-8 become U+FFFD.
``jsonl``
    The same path rules; every non-blank line must be a JSON object whose
    ``cfg.jsonl_text_field`` is a string, which is the document.
``chat-jsonl``
    The same path rules; every non-blank line is a conversation ``{"messages": [{"role",
    "content"}, ...]}`` (OpenAI's fine-tuning format; other keys are ignored). The cache
    renders each one with the chat template (:func:`iter_conversations`); as text (the BPE
    trainer's corpus, :func:`iter_documents`) a conversation is its contents, one per line.
``stdlib``
    The ``.py`` files of this interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), recursively, in sorted relative-path order. Skipped
    directories: ``site-packages``/``dist-packages`` (installed packages, not the stdlib),
    ``__pycache__``, and the test suites ``test``/``tests``/``idle_test`` (they hold
    deliberately malformed and huge generated files).

``cfg.max_bytes`` caps the total UTF-8 bytes yielded: the document that crosses the cap is
truncated at the last whole character that fits and nothing is read after it, so the total
is always ``<= max_bytes``.

Relative paths in ``cfg.paths`` are relative to the current working directory.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from jaxlab.config.schema import DataConfig

# Bump when the synthetic generator's output changes: it is part of the fingerprint.
SYNTHETIC_VERSION = 1
_SYNTHETIC_SEED = 0x6A61_786C_6162_0001  # "jaxlab" + version; fixed, never global state

STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)

_GLOB_CHARS = frozenset("*?[")

# ---------------------------------------------------------------------------------------
# File resolution
# ---------------------------------------------------------------------------------------


def resolve_files(cfg: DataConfig) -> list[Path]:
    """The files a ``text``/``jsonl``/``stdlib`` source reads, in reading order.

    Raises ``ValueError`` naming ``data.paths`` for an empty list, a glob matching no file,
    a missing literal path or a directory. Returns ``[]`` for ``synthetic``.
    """
    if cfg.source == "synthetic":
        return []
    if cfg.source == "stdlib":
        return stdlib_files()
    if not cfg.paths:
        raise ValueError(
            f"data.paths: source {cfg.source!r} needs at least one file or glob (got [])"
        )
    seen: set[Path] = set()
    out: list[Path] = []
    for pattern in cfg.paths:
        if _GLOB_CHARS.intersection(pattern):
            matches = sorted(
                Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True)
            )
            files = [p for p in matches if p.is_file()]
            if not files:
                raise ValueError(f"data.paths: pattern {pattern!r} matched no files")
        else:
            path = Path(pattern).expanduser()
            if path.is_dir():
                raise ValueError(
                    f"data.paths: {pattern!r} is a directory; use a glob such as "
                    f"'{pattern.rstrip('/')}/**/*.txt'"
                )
            if not path.is_file():
                raise ValueError(f"data.paths: file {pattern!r} does not exist")
            files = [path]
        for f in files:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Standard-library ``.py`` files, sorted by relative path (see module docstring)."""
    root = stdlib_root()
    rel: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk descending into skipped trees at all.
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        base = Path(dirpath).relative_to(root)
        rel.extend((base / f).as_posix() for f in filenames if f.endswith(".py"))
    return [root / r for r in sorted(rel)]


# ---------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Yield the documents of ``cfg``'s source, in a deterministic order, capped by max_bytes."""
    docs: Iterator[str]
    if cfg.source == "synthetic":
        docs = (synthetic_document(i) for i in range(cfg.synthetic_docs))
        return _cap(docs, cfg.max_bytes)
    if cfg.source == "chat-jsonl":
        return ("\n".join(m["content"] for m in conv) for conv in iter_conversations(cfg))
    files = resolve_files(cfg)
    if cfg.source == "jsonl":
        return _cap(_iter_jsonl(files, cfg.jsonl_text_field), cfg.max_bytes)
    return _iter_files_capped(files, cfg.max_bytes)


def _cap(docs: Iterator[str], max_bytes: int | None) -> Iterator[str]:
    if max_bytes is None:
        yield from docs
        return
    remaining = max_bytes
    for doc in docs:
        data = doc.encode("utf-8")
        if len(data) >= remaining:
            # errors="ignore" drops the partial character the byte cut may leave.
            yield data[:remaining].decode("utf-8", errors="ignore")
            return
        remaining -= len(data)
        yield doc


def _iter_files_capped(files: list[Path], max_bytes: int | None) -> Iterator[str]:
    """One document per file; reads only what the cap can still use."""
    remaining = max_bytes
    for path in files:
        # Read 4 extra bytes: UTF-8 decoding agrees with a full-file decode on every character
        # that ends before the last partial one, and decoded text is never shorter in UTF-8
        # than the bytes it came from, so the first `remaining` bytes come out identical.
        limit = None if remaining is None else remaining + 4
        doc = read_text(path, limit)
        if remaining is None:
            yield doc
            continue
        data = doc.encode("utf-8")
        if len(data) >= remaining:
            yield data[:remaining].decode("utf-8", errors="ignore")
            return
        remaining -= len(data)
        yield doc


def read_text(path: Path, limit: int | None = None) -> str:
    """Read a file as UTF-8 (invalid bytes -> U+FFFD), at most ``limit`` bytes of it."""
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    return raw.decode("utf-8", errors="replace")


def _iter_jsonl(files: list[Path], field: str) -> Iterator[str]:
    for path in files:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = raw.decode("utf-8", errors="replace").strip()
                if not line:
                    continue  # blank lines (e.g. a trailing newline) are not records
                try:
                    obj: Any = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
                if not isinstance(obj, dict):
                    raise ValueError(
                        f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}"
                    )
                if field not in obj:
                    raise ValueError(
                        f"{path}:{lineno}: no field {field!r} (data.jsonl_text_field); "
                        f"keys are {sorted(obj)[:10]}"
                    )
                text = obj[field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{path}:{lineno}: field {field!r} (data.jsonl_text_field) must be a "
                        f"string, got {type(text).__name__}"
                    )
                yield text


def conversation_bytes(messages: list[dict[str, str]]) -> int:
    """UTF-8 bytes of a conversation's contents: what ``max_bytes`` counts for chat."""
    return sum(len(m["content"].encode("utf-8")) for m in messages)


def iter_conversations(cfg: DataConfig) -> Iterator[list[dict[str, str]]]:
    """The conversations of a ``chat-jsonl`` source, in file and line order; the one that
    crosses ``max_bytes`` (:func:`conversation_bytes`) is the last, whole. Every message
    is checked here (roles, string contents), so an error names the file and line."""
    from jaxlab.tokenizer.chat import ChatTemplateError, as_messages

    remaining = cfg.max_bytes
    for path in resolve_files(cfg):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = raw.decode("utf-8", errors="replace").strip()
                if not line:
                    continue
                try:
                    obj: Any = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from e
                if not isinstance(obj, dict) or "messages" not in obj:
                    raise ValueError(
                        f"{path}:{lineno}: expected an object with a 'messages' list "
                        "(data.source = 'chat-jsonl')"
                    )
                try:
                    msgs = as_messages(obj["messages"])
                except ChatTemplateError as e:
                    raise ValueError(f"{path}:{lineno}: {e}") from None
                conv = [{"role": m.role, "content": m.content} for m in msgs]
                yield conv
                if remaining is not None:
                    remaining -= conversation_bytes(conv)
                    if remaining <= 0:
                        return


# ---------------------------------------------------------------------------------------
# Fingerprint and description
# ---------------------------------------------------------------------------------------


def source_fingerprint(cfg: DataConfig) -> str:
    """Hex SHA-256 of everything that decides which documents ``iter_documents`` yields.

    Covers the source kind and its parameters (``max_bytes`` included), and for file
    sources each file's resolved path, size and mtime (for ``stdlib`` also the Python
    version and stdlib root), so editing, adding or removing a file changes it.
    """
    info: dict[str, Any] = {"source": cfg.source, "max_bytes": cfg.max_bytes}
    if cfg.source == "synthetic":
        info |= {"synthetic_docs": cfg.synthetic_docs, "version": SYNTHETIC_VERSION}
    else:
        if cfg.source == "jsonl":
            info["jsonl_text_field"] = cfg.jsonl_text_field
        if cfg.source == "chat-jsonl":
            from jaxlab.tokenizer.chat import TEMPLATE_VERSION

            info["chat_template_version"] = TEMPLATE_VERSION
        if cfg.source == "stdlib":
            info |= {"python": sys.version, "stdlib": str(stdlib_root())}
        else:
            info["paths"] = list(cfg.paths)
        files = []
        for p in resolve_files(cfg):
            st = p.stat()
            files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
        info["files"] = files
    blob = json.dumps(info, sort_keys=True, ensure_ascii=True).encode("ascii")
    return hashlib.sha256(blob).hexdigest()


def describe_source(cfg: DataConfig) -> str:
    """A one-line human description, for logs and the cache's meta file."""
    cap = "" if cfg.max_bytes is None else f", max_bytes={cfg.max_bytes}"
    if cfg.source == "synthetic":
        return f"synthetic (v{SYNTHETIC_VERSION}, {cfg.synthetic_docs} docs{cap})"
    if cfg.source == "stdlib":
        v = sys.version_info
        return f"stdlib ({stdlib_root()}, Python {v.major}.{v.minor}.{v.micro}{cap})"
    field = f", field={cfg.jsonl_text_field!r}" if cfg.source == "jsonl" else ""
    return f"{cfg.source} ({', '.join(cfg.paths)}{field}{cap})"


def estimate_total_bytes(cfg: DataConfig) -> int | None:
    """Bytes the source will roughly yield, for a progress total; ``None`` if unknown.

    File sources sum file sizes (an upper bound for ``jsonl``, whose JSON syntax is not
    text), capped by ``max_bytes``. ``synthetic`` reports ``None``: its size is only known
    by generating it.
    """
    if cfg.source == "synthetic":
        return None
    total = sum(p.stat().st_size for p in resolve_files(cfg))
    return total if cfg.max_bytes is None else min(total, cfg.max_bytes)


# ---------------------------------------------------------------------------------------
# Synthetic generator
# ---------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# fmt: off
_WORDS = (
    "the", "cat", "dog", "sat", "ran", "on", "a", "mat", "red", "blue", "green", "sun",
    "moon", "tree", "big", "small", "fast", "slow", "bird", "fish", "sky", "sea", "hill",
    "road", "old", "new", "cold", "warm", "day", "night",
)
# fmt: on


class _SplitMix64:
    """A tiny PRNG with a fixed, documented algorithm: its output never changes across
    Python or numpy versions (unlike ``random.Random.choice`` or ``Generator.integers``),
    so the synthetic corpus, and hence its cache key, is stable forever."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform-enough integer in ``[0, n)`` (multiply-shift; bias ~ n / 2**64)."""
        return (self.next_u64() * n) >> 64

    def between(self, lo: int, hi: int) -> int:
        """Integer in ``[lo, hi]``."""
        return lo + self.below(hi - lo + 1)


def _count(r: _SplitMix64) -> str:
    start, n = r.between(0, 90), r.between(5, 12)
    return "count: " + " ".join(str(start + k) for k in range(n))


def _countdown(r: _SplitMix64) -> str:
    start = r.between(12, 60)
    n = r.between(5, 12)
    return "down: " + " ".join(str(start - k) for k in range(n))


def _letters(r: _SplitMix64) -> str:
    start, n = r.below(26), r.between(5, 14)
    return "abc: " + " ".join(_LETTERS[(start + k) % 26] for k in range(n))


def _sums(r: _SplitMix64) -> str:
    parts = []
    for _ in range(r.between(2, 4)):
        a, b = r.between(0, 20), r.between(0, 20)
        parts.append(f"{a}+{b}={a + b}")
    return "sum: " + " ".join(parts)


def _copy(r: _SplitMix64) -> str:
    word = "".join(_LETTERS[r.below(26)] for _ in range(r.between(3, 6)))
    return "copy: " + " ".join([word] * r.between(2, 4))


def _phrase(r: _SplitMix64) -> str:
    phrase = " ".join(_WORDS[r.below(len(_WORDS))] for _ in range(r.between(3, 5)))
    return "say: " + ". ".join([phrase] * r.between(2, 3)) + "."


_TASKS: tuple[Callable[[_SplitMix64], str], ...] = (
    _count,
    _countdown,
    _letters,
    _sums,
    _copy,
    _phrase,
)


def synthetic_document(index: int) -> str:
    """Synthetic document ``index``: 2-5 lines, each one pattern task (a pure function)."""
    r = _SplitMix64(_SYNTHETIC_SEED ^ ((index * 0xD1B54A32D192ED03) & _MASK64))
    lines = [_TASKS[r.below(len(_TASKS))](r) for _ in range(r.between(2, 5))]
    return "\n".join(lines) + "\n"
