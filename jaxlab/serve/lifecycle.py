"""The model's lifecycle as a state machine with only legal transitions.

::

    empty -> loading -> warming -> ready -> draining -> stopped
               |           |         |         |
               +-----------+---------+---------+--> failed

``loading`` and ``warming`` may also go straight to ``stopped`` (a shutdown before the
model was ready). ``stopped`` and ``failed`` are terminal. Any other transition raises
:class:`IllegalTransition`. ``/ready`` answers 200 only in ``ready``; the
``jaxlab_model_state`` gauge is 1 for the current state and 0 for the others. It holds
no model and starts no thread: the service (:mod:`jaxlab.serve.service`) drives it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class ModelState(enum.StrEnum):
    EMPTY = "empty"
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


S = ModelState

#: Every legal transition; anything else is a bug and raises.
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    S.EMPTY: frozenset({S.LOADING, S.STOPPED}),
    S.LOADING: frozenset({S.WARMING, S.FAILED, S.STOPPED}),
    S.WARMING: frozenset({S.READY, S.FAILED, S.STOPPED}),
    S.READY: frozenset({S.DRAINING, S.FAILED}),
    S.DRAINING: frozenset({S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    S.FAILED: frozenset(),
}

TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)

Listener = Callable[[ModelState, ModelState], None]


class IllegalTransition(RuntimeError):
    """A lifecycle transition the state machine does not allow."""


class Lifecycle:
    """Thread-safe current state, its history, and listeners called on every change.

    Listeners run on the thread that made the transition, outside the lock, with
    ``(old, new)``; they must not block.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._state = ModelState.EMPTY
        self.history: list[tuple[ModelState, float]] = [(ModelState.EMPTY, time.time())]
        self.error: str | None = None
        self._listeners: list[Listener] = []

    @property
    def state(self) -> ModelState:
        return self._state

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def can(self, new: ModelState) -> bool:
        return new in TRANSITIONS[self._state]

    def to(self, new: ModelState, *, error: str | None = None) -> ModelState:
        """Move to ``new``; return the old state. Raises :class:`IllegalTransition`."""
        with self._lock:
            old = self._state
            if new not in TRANSITIONS[old]:
                allowed = ", ".join(sorted(TRANSITIONS[old])) or "none (terminal)"
                raise IllegalTransition(
                    f"model state {old} -> {new} is not allowed (from {old}: {allowed})"
                )
            self._state = new
            self.history.append((new, time.time()))
            if error is not None:
                self.error = error
            self._changed.notify_all()
        for fn in list(self._listeners):
            fn(old, new)
        return old

    def wait_for(self, states: set[ModelState], timeout: float | None = None) -> ModelState:
        """Block until the state is one of ``states`` (or a terminal one, or the timeout)."""
        with self._lock:
            self._changed.wait_for(
                lambda: self._state in states or self._state in TERMINAL, timeout=timeout
            )
            return self._state


__all__ = ["TERMINAL", "TRANSITIONS", "IllegalTransition", "Lifecycle", "ModelState"]
