"""Token ids -> text deltas for one sequence: incremental UTF-8 and stop strings.

:class:`Detokenizer` is fed one token at a time (the server's output processing, the
CLI's ``--stream``). It

- never splits a UTF-8 character (an incremental decoder holds incomplete bytes;
  invalid bytes become U+FFFD, exactly as ``Tokenizer.decode(errors="replace")`` does
  for the whole sequence at once),
- maps ids the tokenizer does not know (a model whose ``vocab_size`` exceeds the
  tokenizer's ``n_vocab`` can sample them) to U+FFFD instead of raising,
- matches stop strings on the decoded text: at the first occurrence of any of them the
  text is truncated just before it and the request stops, and
- never emits text that might turn out to be the start of a stop string: a suffix that
  is a proper prefix of some stop string is held back until the next token decides.

So the concatenated deltas always equal the final text (streaming == non-streaming).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd".encode()


class _Detok(Protocol):
    @property
    def n_vocab(self) -> int: ...

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


class Detokenizer:
    def __init__(self, tokenizer: _Detok, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._n_vocab = tokenizer.n_vocab
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string matched
        self.finished = False

    def _bytes(self, token: int) -> bytes:
        if 0 <= token < self._n_vocab:
            return self._tok.decode_bytes([token])
        return REPLACEMENT

    def feed(self, token: int) -> str:
        """Add one token; return the text that is now safe to emit (maybe empty)."""
        if self.stopped or self.finished:
            return ""
        return self._append(self._dec.decode(self._bytes(token)))

    def finish(self) -> str:
        """No more tokens: flush the decoder and release any held-back text."""
        if self.finished:
            return ""
        delta = "" if self.stopped else self._append(self._dec.decode(b"", final=True))
        self.finished = True
        rest = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta + rest

    def _append(self, new: str) -> str:
        if not new:
            return ""
        search_from = max(0, len(self.text) - self._longest + 1)
        self.text += new
        if self.stop:
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                out = self.text[self.emitted :]
                self.emitted = len(self.text)
                return out
        safe = len(self.text) - self._held()
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def _held(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


__all__ = ["Detokenizer"]
