"""Shape-keyed compilation with the AOT API: every compile is explicit, timed and counted.

``jax.jit`` caches executables by input signature behind the scenes; here the cache is
ours, keyed by the (treedef, shapes, dtypes, shardings) of the arguments, so that

- the first compile is timed in its three phases (trace, lower, compile),
- every compile is counted per function (tests assert bounded compile counts; the
  inference engine and server export them as metrics),
- a compile after the first one is reported in one line: the function, what changed
  (which input's shape, dtype or sharding) and how long it took; a WARNING unless new
  shapes are expected (``warn_on_recompile=False``, or inside :func:`new_shapes_expected`,
  as in a benchmark sweep), the whole input signature at DEBUG,
- a compile served from JAX's persistent compilation cache
  (:func:`jaxlab.runtime.enable_compilation_cache`) is marked as such.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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


# Inside a benchmark sweep every new shape is by design. Process-wide, not per thread: a
# sweep may compile on threads of its own (a server's scheduler).
_expected_lock = threading.Lock()
_expected_depth = 0


@contextlib.contextmanager
def new_shapes_expected() -> Iterator[None]:
    """Within this block a recompile for a new input signature is expected (a sweep over
    batch sizes or lengths): it is logged at INFO instead of as a WARNING."""
    global _expected_depth
    with _expected_lock:
        _expected_depth += 1
    try:
        yield
    finally:
        with _expected_lock:
            _expected_depth -= 1


def _leaf(s: Any) -> str:
    if s[0] != "py":
        return f"{s[1]}{list(s[0])}"
    return s[1] if s[2] is None else repr(s[2])


def _leaf_change(path: str, old: Any, new: Any) -> str:
    if "py" in (old[0], new[0]):  # a Python value, or an array where one was
        return f"{path} {_leaf(old)} -> {_leaf(new)}"
    if old[0] != new[0]:
        return f"{path} shape {old[0]} -> {new[0]}"
    if old[1] != new[1]:
        return f"{path} dtype {old[1]} -> {new[1]}"
    return f"{path} sharding {old[2]} -> {new[2]}"


def what_changed(
    seen: Sequence[tuple[Any, ...]], sig: tuple[Any, ...], args: Sequence[Any], names: Sequence[str]
) -> str:
    """One line: how ``sig`` (of ``args``) differs from the closest signature in ``seen``.

    ``names`` name the positional arguments (``state``, ``batch``); leaves are named by
    their path inside them (``batch['tokens']``)."""
    same_tree = [old for old in seen if old[0] == sig[0]]
    if not same_tree:
        return "a new input structure (a different pytree of arguments)"
    closest = min(
        same_tree, key=lambda old: sum(a != b for a, b in zip(old[1], sig[1], strict=True))
    )
    changed = [i for i, (a, b) in enumerate(zip(closest[1], sig[1], strict=True)) if a != b]
    if not changed:  # equal signatures are never recompiled; kept total for safety
        return "an equal signature"
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tuple(args))[0]]
    first = paths[changed[0]]
    index = getattr(first[0], "idx", None)
    head = names[index] if isinstance(index, int) and index < len(names) else "args"
    line = _leaf_change(
        head + jax.tree_util.keystr(tuple(first[1:])), closest[1][changed[0]], sig[1][changed[0]]
    )
    more = len(changed) - 1
    return line + (f" (and {more} more input{'s' if more > 1 else ''})" if more else "")


def _arg_names(fn: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


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
        if self.timings:
            self._report_recompile(sig, args, timing)
        self.timings.append(timing)
        self._cache[sig] = compiled
        return compiled

    def _report_recompile(
        self, sig: tuple[Any, ...], args: Sequence[Any], t: CompileTiming
    ) -> None:
        """One line (WARNING unless new shapes are expected); the signature at DEBUG."""
        if not self.warn_on_recompile:
            level = logging.DEBUG
        elif _expected_depth:
            level = logging.INFO
        else:
            level = logging.WARNING
        if log.isEnabledFor(level):
            changed = what_changed(list(self._cache), sig, args, _arg_names(self.fn))
            log.log(
                level,
                "%s recompiled (compile #%d, %.2fs): %s",
                self.name,
                len(self.timings) + 1,
                t.total_s,
                changed,
            )
        log.debug("%s input signature: %s", self.name, t.signature)

    def __call__(self, *args: Any) -> Any:
        sig = signature(args)
        compiled = self._cache.get(sig)
        if compiled is None:
            compiled = self.compile_for(*args)
        return compiled(*args)
