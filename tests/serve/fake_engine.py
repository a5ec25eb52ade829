"""A fake engine for the scheduler's tests: the engine's device verbs over numpy, no jax.

:class:`FakeEngine` answers ``init_decode_state``, ``prefill``, ``insert`` and
``generate`` as :class:`jaxlab.infer.engine.Engine` does (the same shapes, the same
``done``/budget/stop-token rules, ``-1`` for "no token", donated states), but a row's
``t``-th token is a pure function of its prompt, seed and ``t`` (:func:`token_at`), so
what a request gets never depends on its batch, its slot or when it was admitted, and
:meth:`FakeEngine.reference` says what it must get. Tokens are lower-case ASCII letters
(ids 97-122), so the byte tokenizer turns them into text.

For the tests it also records every call (``calls``), counts "compiles" (distinct
shapes per verb, as ``ShapeKeyedJit`` does), refuses a donated state, and fails or waits
on demand (:meth:`fail_next`, :meth:`fail_prompt`, ``gate``).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from jaxlab.infer.request import Limits, Request
from jaxlab.infer.sampling import MAX_STOP_TOKENS, SamplingParams

NO_TOKEN = -1


def token_at(prompt: Sequence[int], seed: int, t: int) -> int:
    """The ``t``-th generated token of a request (``t = 0``: prefill's)."""
    key = zlib.crc32(np.asarray([*prompt, seed], np.int64).tobytes())
    return 97 + (key + 5 * t + t * t) % 26


@dataclass
class FakeState:
    """:class:`~jaxlab.infer.state.DecodeState`'s per-row fields, as numpy arrays."""

    key_prompt: list[tuple[int, ...]]  # per row: the prompt (the token function's input)
    seed: np.ndarray  # i32[B]
    pos: np.ndarray  # i32[B]
    generated: np.ndarray  # i32[B]
    done: np.ndarray  # bool[B]
    max_new: np.ndarray  # i32[B]
    stop: np.ndarray  # i32[B, MAX_STOP_TOKENS], -1 = unused
    tokens: np.ndarray  # i32[B]: each row's last token
    donated: bool = False

    @property
    def slots(self) -> int:
        return len(self.done)

    def copy(self) -> FakeState:
        return FakeState(
            key_prompt=list(self.key_prompt),
            seed=self.seed.copy(),
            pos=self.pos.copy(),
            generated=self.generated.copy(),
            done=self.done.copy(),
            max_new=self.max_new.copy(),
            stop=self.stop.copy(),
            tokens=self.tokens.copy(),
        )


class Prefill(NamedTuple):
    state: FakeState
    tokens: np.ndarray
    done: np.ndarray
    bucket: int | None


class FakeEngine:
    platform = "cpu"
    precision = "float32"
    compile_cache_hits = 0

    def __init__(
        self, *, vocab_size: int = 258, max_len: int = 64, buckets: Sequence[int] = (16, 64)
    ) -> None:
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.buckets = tuple(buckets)
        self.calls: list[tuple[Any, ...]] = []
        self.shapes: dict[str, set[tuple[int, ...]]] = {"prefill": set(), "insert": set()}
        self.shapes["generate"] = set()
        #: While cleared, ``generate`` waits for it (a slow device).
        self.gate = threading.Event()
        self.gate.set()
        self._fail: dict[str, Exception] = {}
        self._poison: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ facts

    @property
    def compiles(self) -> dict[str, int]:
        return {verb: len(shapes) for verb, shapes in self.shapes.items() if shapes}

    def limits(self, eos_id: int | None = None) -> Limits:
        return Limits(self.vocab_size, self.max_len, eos_id)

    def fail_next(self, verb: str, error: Exception | None = None) -> None:
        """Make the next call of ``verb`` raise."""
        self._fail[verb] = error or RuntimeError(f"{verb} broke")

    def fail_prompt(self, prompt: Sequence[int]) -> None:
        """Make every prefill that holds ``prompt`` raise (alone or in a batch)."""
        self._poison.add(tuple(prompt))

    def reference(self, request: Request) -> list[int]:
        """Every token ``request`` gets alone, its stop token included."""
        out: list[int] = []
        for t in range(request.sampling.max_new_tokens):
            out.append(token_at(request.prompt_ids, request.sampling.seed, t))
            if out[-1] in request.stop_ids:
                break
        return out

    def _called(self, verb: str, shape: tuple[int, ...], *details: Any) -> None:
        with self._lock:
            self.shapes[verb].add(shape)
            self.calls.append((verb, *details))
            error = self._fail.pop(verb, None)
        if error is not None:
            raise error

    @staticmethod
    def _take(state: FakeState) -> FakeState:
        if state.donated:
            raise RuntimeError("a donated state was used again")
        state.donated = True
        return state.copy()

    # ------------------------------------------------------------------ the four verbs

    def init_decode_state(self, slots: int) -> FakeState:
        return FakeState(
            [()] * slots,
            np.zeros(slots, np.int32),
            np.zeros(slots, np.int32),
            np.zeros(slots, np.int32),
            np.ones(slots, np.bool_),
            np.zeros(slots, np.int32),
            np.full((slots, MAX_STOP_TOKENS), -1, np.int32),
            np.zeros(slots, np.int32),
        )

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        samplings: Sequence[SamplingParams],
        *,
        bucket: int | None = None,
    ) -> Prefill:
        longest = max(len(p) for p in prompts)
        if bucket is None:
            bucket = next(b for b in self.buckets if b >= longest)
        assert longest <= bucket <= self.max_len and len(prompts) == len(samplings)
        self._called("prefill", (bucket, len(prompts)), [len(p) for p in prompts])
        if any(tuple(p) in self._poison for p in prompts):
            raise RuntimeError("prefill broke on a poisoned prompt")
        st = self.init_decode_state(len(prompts))
        for i, (p, sp) in enumerate(zip(prompts, samplings, strict=True)):
            tok = token_at(p, sp.seed, 0)
            st.key_prompt[i] = tuple(p)
            st.seed[i], st.pos[i], st.generated[i], st.tokens[i] = sp.seed, len(p), 1, tok
            st.max_new[i] = sp.max_new_tokens
            st.stop[i, : len(sp.stop_token_ids)] = sp.stop_token_ids
            st.done[i] = tok in sp.stop_token_ids or sp.max_new_tokens <= 1
        return Prefill(st, st.tokens.copy(), st.done.copy(), bucket)

    def insert(self, prefix: FakeState, state: FakeState, slots: Sequence[int]) -> FakeState:
        assert len(slots) == prefix.slots, (slots, prefix.slots)
        chosen = [s for s in slots if s >= 0]
        assert len(set(chosen)) == len(chosen) and all(s < state.slots for s in chosen), slots
        self._called("insert", (prefix.slots, state.slots), state.slots, list(slots))
        if prefix.donated:
            raise RuntimeError("a donated prefix was inserted")
        new = self._take(state)
        for row, slot in enumerate(slots):
            if slot < 0:
                continue
            new.key_prompt[slot] = prefix.key_prompt[row]
            for name in ("seed", "pos", "generated", "done", "max_new", "stop", "tokens"):
                getattr(new, name)[slot] = getattr(prefix, name)[row]
        return new

    def generate(self, state: FakeState, k: int) -> tuple[FakeState, np.ndarray, np.ndarray]:
        self._called("generate", (k, state.slots), state.slots, threading.current_thread().name)
        self.gate.wait()
        st = self._take(state)
        out = np.full((k, st.slots), NO_TOKEN, np.int32)
        for i in range(k):
            if st.done.all():
                break
            for r in np.flatnonzero(~st.done):
                tok = token_at(st.key_prompt[r], int(st.seed[r]), int(st.generated[r]))
                out[i, r] = st.tokens[r] = tok
                st.generated[r] += 1
                st.pos[r] += 1
                st.done[r] = tok in st.stop[r] or st.generated[r] >= st.max_new[r]
        return st, out, st.done.copy()


__all__ = ["FakeEngine", "FakeState", "Prefill", "token_at"]
