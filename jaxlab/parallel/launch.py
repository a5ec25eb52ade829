"""Start N local processes that form one JAX runtime over loopback.

Each child runs ``python -m jaxlab ARGS`` with ``runtime.distributed`` set through its
environment (mode 'manual', coordinator on 127.0.0.1, its process id) and, optionally,
several simulated CPU devices. The launcher watches them: if one exits non-zero, the
others are terminated at once and the launcher exits with that code, so a dead process
never leaves its peers hanging in a collective. SIGINT/SIGTERM are forwarded. Process 0
writes its stdout (a --json document) to the launcher's ``sys.stdout``; the others' stdout
goes to the launcher's fd 1, which the CLI points at stderr.

On a cluster, skip this launcher: start one process per host with
``JAXLAB_RUNTIME__DISTRIBUTED__MODE=auto`` and let ``jax.distributed`` detect SLURM,
Kubernetes (JobSet) or TPU pods (see docs/sharding.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(i: int, n: int, port: int, devices_per_process: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        JAXLAB_RUNTIME__DISTRIBUTED__MODE="manual",
        JAXLAB_RUNTIME__DISTRIBUTED__COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAXLAB_RUNTIME__DISTRIBUTED__NUM_PROCESSES=str(n),
        JAXLAB_RUNTIME__DISTRIBUTED__PROCESS_ID=str(i),
        PYTHONUNBUFFERED="1",
    )
    if devices_per_process:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    return env


def _output_stream() -> int | None:
    """Process 0's stdout: this process's ``sys.stdout``, which the CLI keeps apart from
    fd 1 (``jaxlab.cli.common.reserve_stdout``); None (inherit fd 1) without a descriptor."""
    try:
        sys.stdout.flush()
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def launch(
    args: Sequence[str],
    n: int,
    *,
    devices_per_process: int | None = None,
    log_dir: Path | None = None,
    poll_s: float = 0.1,
) -> int:
    """Run ``jaxlab ARGS`` in ``n`` processes; return the first non-zero exit code or 0."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    for i in range(n):
        # Process 0 prints the command's output (the --json document). What the others
        # print to stdout goes where this process's fd 1 goes: stderr, under the CLI.
        out: Any = _output_stream() if i == 0 else None
        if i > 0 and log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            f = open(log_dir / f"process-{i}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(f)
            out = f
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "jaxlab", *args],
                env=child_env(i, n, port, devices_per_process),
                stdout=out,
                stderr=subprocess.STDOUT if i > 0 and out is not None else None,
            )
        )

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(
                    f"jaxlab launch: process {i} exited with code {code}; stopping the others",
                    file=sys.stderr,
                )
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.time() + 10
                for p in procs:
                    try:
                        p.wait(timeout=max(0.1, deadline - time.time()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(poll_s)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for f in logs:
            f.close()
    return int(code if code >= 0 else 128 - code)
