"""The peer side of a benchmark session: JSON lines on stdin, one JSON answer per line.

A peer script runs under another Python (one with the peer's framework), which may not
have jaxlab, so this module uses the standard library only and is imported by file
location (the peer script's own folder is first on ``sys.path``).

Why a session rather than one process per case: the harness alternates the peer's
samples with jaxlab's (peer, jaxlab, peer, jaxlab, ...) so both sides are timed under the
same machine conditions; on a shared VM a ratio of two medians taken minutes apart mixes
the two implementations' speed with whatever the neighbours did in between.

Requests and answers (every answer has ``ok``; a failed one has ``error`` instead)::

    {"op": "prepare", "id": "gen-b1", "spec": {...}}  ->  {"ok": true, "info": {...}}
    {"op": "time", "id": "gen-b1", "warm": 1}          ->  {"ok": true, "s": 0.41}
    {"op": "drop", "id": "gen-b1"}                     ->  {"ok": true}

``prepare`` builds the case and runs ``spec["warmup"]`` untimed calls; ``time`` runs it
once and answers the seconds it took (``time.perf_counter`` around the call, nothing
else), after ``warm`` untimed calls (default 0) that give the timed one the caches its own
previous call leaves. The session ends at end of input.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, TextIO

#: ``prepare(spec) -> (run, info)``: ``run()`` is one repetition of the case.
Prepare = Callable[[dict[str, Any]], tuple[Callable[[], Any], dict[str, Any]]]


def serve(prepare: Prepare, stdin: TextIO | None = None, stdout: TextIO | None = None) -> None:
    """Answer requests until end of input. Anything else the process prints goes to
    stderr, so a library's chatter cannot corrupt the protocol stream."""
    inp = stdin or sys.stdin
    out = stdout or sys.stdout
    if stdout is None:
        sys.stdout = sys.stderr
    cases: dict[str, Callable[[], Any]] = {}
    for line in inp:
        if not line.strip():
            continue
        try:
            answer = _handle(json.loads(line), cases, prepare)
        except Exception as e:
            tail = traceback.format_exc().strip().splitlines()[-6:]
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": tail}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _handle(
    req: dict[str, Any], cases: dict[str, Callable[[], Any]], prepare: Prepare
) -> dict[str, Any]:
    op, key = req.get("op"), req.get("id")
    if op == "prepare":
        spec = req["spec"]
        run, info = prepare(spec)
        for _ in range(int(spec.get("warmup", 1))):
            run()
        cases[str(key)] = run
        return {"ok": True, "info": info}
    if op == "time":
        run = cases.get(str(key))
        if run is None:
            raise KeyError(f"no prepared case {key!r}; prepare it first")
        for _ in range(int(req.get("warm", 0))):
            run()
        t0 = time.perf_counter()
        run()
        return {"ok": True, "s": time.perf_counter() - t0}
    if op == "drop":
        cases.pop(str(key), None)
        return {"ok": True}
    raise ValueError(f"unknown op {op!r}; expected prepare, time or drop")
