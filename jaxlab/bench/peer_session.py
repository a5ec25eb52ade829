"""The harness side of a peer session (protocol in ``jaxlab/bench/peers/protocol.py``).

One peer process lives for the whole suite, with its cases prepared (built and warmed
up) once; :meth:`PeerSession.time` asks it for one timed repetition. The suite calls that
between jaxlab's own repetitions, so each side's samples interleave with the other's.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any


class PeerError(RuntimeError):
    """The peer answered an error, or died, or stopped answering."""


class PeerSession:
    """``with PeerSession(python, script) as peer: peer.prepare("a", spec); peer.time("a")``.

    The peer's stderr goes to a temporary file (a full pipe could block it) whose tail
    every :class:`PeerError` quotes.
    """

    def __init__(self, python: str, script: str | Path, *, timeout_s: float = 1800) -> None:
        self.timeout_s = timeout_s
        # lives as long as the session; close() closes it
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [python, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            bufsize=1,
        )

    # ------------------------------------------------------------------ requests

    def prepare(self, key: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Build case ``key`` in the peer and run its warm-up; returns what it reports."""
        return self._ask({"op": "prepare", "id": key, "spec": spec})["info"]

    def time(self, key: str, warm: int = 0) -> float:
        """Seconds of one repetition of case ``key``, timed inside the peer, after ``warm``
        untimed ones."""
        return float(self._ask({"op": "time", "id": key, "warm": warm})["s"])

    def drop(self, key: str) -> None:
        """Free case ``key`` (its model and data) in the peer."""
        self._ask({"op": "drop", "id": key})

    def close(self) -> None:
        proc = self._proc
        if proc.stdin and not proc.stdin.closed:
            # a peer that died leaves unsent bytes behind; flushing them fails, the
            # pipe is closed all the same
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        what = f"{request['op']} {request['id']!r}"
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise PeerError(f"peer {what}: the peer is gone{self._exit_note()}") from None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                proc.kill()
                raise PeerError(f"peer {what}: no answer in {self.timeout_s:.0f} s (killed)")
        line = proc.stdout.readline()
        if not line:
            # it closed its stdout: let it finish exiting so the exit code is known
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            raise PeerError(f"peer {what}: the peer exited{self._exit_note()}")
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"peer {what}: not a protocol answer: {line.strip()[:200]!r}") from None
        if not answer.get("ok"):
            detail = " | ".join(answer.get("traceback") or [])
            raise PeerError(
                f"peer {what}: {answer.get('error')}" + (f" ({detail})" if detail else "")
            )
        return answer

    def _exit_note(self) -> str:
        code = self._proc.poll()
        self._stderr.flush()
        self._stderr.seek(0)
        tail = self._stderr.read().strip()[-800:]
        status = f" with code {code}" if code is not None else ""
        return f"{status}; stderr: {tail}" if tail else status
