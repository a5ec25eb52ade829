"""Shape-keyed compilation with the AOT API: every compile is explicit, timed and counted.

``jax.jit`` caches executables by input signature behind the scenes; here the cache is
ours, keyed by the (treedef, shapes, dtypes, shardings) of the arguments, so that

- the first compile is timed in its three phases (trace, lower, compile),
- every compile is counted per function (tests assert bounded compile counts; the
  inference engine and server export them as metrics),
- a compile after the first one is reported with the signature that caused it,
- a compile served from JAX's persistent compilation cache
  (:func:`jaxlab.runtime.enable_compilation_cache`) is marked as such.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

log = logging.getLogger("jaxlab.compile")


@dataclass(frozen=True)
class CompileTiming:
    name: str
    signature: str
    trace_s: float
    lower_s: float
    compile_s: float
    #: The executable was loaded from the persistent compilation cache, not compiled.
    cached: bool = False

    @property
    def total_s(self) -> float:
        return self.trace_s + self.lower_s + self.compile_s


# Persistent-cache hits of this thread: JAX reports each hit as a monitoring event from
# the thread that compiles, so a per-thread count brackets one compile exactly.
_hits = threading.local()
_listener_lock = threading.Lock()
_listening = False
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_: Any) -> None:
    if event == CACHE_HIT_EVENT:
        _hits.n = getattr(_hits, "n", 0) + 1


def persistent_cache_hits() -> int:
    """Persistent compilation cache hits seen on this thread so far."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    return getattr(_hits, "n", 0)


def _leaf_sig(x: Any) -> Any:
    # Runs for every leaf on every call (the decode loop's dispatch path): plain attribute
    # reads of hashable objects only; formatting strings here was a measurable share of a
    # decode call (docs/performance.md).
    shape = getattr(x, "shape", None)
    if shape is None:
        return ("py", type(x).__name__, x if isinstance(x, (int, float, bool, str)) else None)
    return (tuple(shape), getattr(x, "dtype", None), getattr(x, "sharding", None))


def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    leaves, treedef = jax.tree.flatten(args)
    return (treedef, tuple(_leaf_sig(x) for x in leaves))


def describe(sig: tuple[Any, ...]) -> str:
    return ", ".join(f"{s[1]}{list(s[0])}" if s[0] != "py" else f"{s[1]}" for s in sig[1])


@dataclass
class ShapeKeyedJit:
    """A jitted function whose executables are cached by an explicit shape key."""

    fn: Callable[..., Any]
    name: str
    donate_argnums: tuple[int, ...] = ()
    out_shardings: Any = None
    warn_on_recompile: bool = True
    timings: list[CompileTiming] = field(default_factory=list)
    _cache: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Static configuration is closed over by ``fn``; every argument is an array pytree.
        kwargs: dict[str, Any] = {"donate_argnums": self.donate_argnums}
        if self.out_shardings is not None:
            kwargs["out_shardings"] = self.out_shardings
        self._jitted = jax.jit(self.fn, **kwargs)

    @property
    def compiles(self) -> int:
        return len(self.timings)

    def compile_for(self, *args: Any) -> Any:
        """Trace, lower and compile for these arguments' signature (no execution)."""
        sig = signature(args)
        if sig in self._cache:
            return self._cache[sig]
        t0 = time.perf_counter()
        traced = self._jitted.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        hits = persistent_cache_hits()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        cached = persistent_cache_hits() > hits
        timing = CompileTiming(self.name, describe(sig), t1 - t0, t2 - t1, t3 - t2, cached)
        if self.timings and self.warn_on_recompile:
            log.warning(
                "%s recompiled (compile #%d, %.2fs) for a new input signature: %s",
                self.name,
                len(self.timings) + 1,
                timing.total_s,
                timing.signature,
            )
        self.timings.append(timing)
        self._cache[sig] = compiled
        return compiled

    def __call__(self, *args: Any) -> Any:
        sig = signature(args)
        compiled = self._cache.get(sig)
        if compiled is None:
            compiled = self.compile_for(*args)
        return compiled(*args)
