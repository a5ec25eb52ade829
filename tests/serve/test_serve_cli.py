"""``jaxlab serve`` as a user runs it: a real subprocess, SIGTERM draining, usage errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, RUN_STEPS, clean_env, run_cli, tiny_run_dir
from test_serve_api import wait_until


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run_dir(tmp_path_factory)  # trained once per session, shared


def test_serve_help_never_imports_jax():
    import re

    r = run_cli("serve", "--help", python_flags=("-X", "importtime"))
    assert r.returncode == 0
    mods = {
        m.group(1).split(".")[0]
        for line in r.stderr.splitlines()
        if (m := re.match(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", line))
    }
    assert "jaxlab" in mods and not mods & {"jax", "jaxlib", "flax", "orbax"}
    assert "--run-dir" in r.stdout and "--port" in r.stdout


def test_serve_usage_errors_exit_2(run_dir, tmp_path):
    r = run_cli("serve", "--run-dir", str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a run directory" in r.stderr
    r = run_cli("serve", "--run-dir", str(run_dir), "--set", "model.d_model=128")
    assert r.returncode == 2 and "only overrides" in r.stderr
    r = run_cli("serve", "--run-dir", str(run_dir), "--step", "999")
    assert r.returncode == 2 and "no such checkpoint" in r.stderr
    r = run_cli(
        "serve", "--run-dir", str(run_dir), "--slots", "6", "--set", "serve.decode_groups=4"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "serve.decode_groups: must divide serve.slots (got 4 and 6)" in r.stderr
    spec = ("--set", "inference.speculative.method=draft")
    r = run_cli("serve", "--run-dir", str(run_dir), *spec)
    assert r.returncode == 2 and "needs inference.speculative.draft_run_dir" in r.stderr
    where = f"inference.speculative.draft_run_dir={tmp_path}"
    r = run_cli("serve", "--run-dir", str(run_dir), *spec, "--set", where)
    assert r.returncode == 2 and "not a run directory with checkpoints" in r.stderr
    assert "Traceback" not in r.stderr


#: The servers here share one prefill bucket (fewer compiles, the same ones in every test,
#: from the session's compilation cache after the first); 48 tokens take >= 1.5 s at 0.25 s
#: a chunk: a request is surely in flight at SIGTERM.
ONE_BUCKET = ("--set", "inference.prefill_buckets=[128]", "--chunk-delay-s", "0.25")


class Served:
    """``jaxlab serve`` in a subprocess on an ephemeral port, its output in files."""

    def __init__(self, run_dir: Path, tmp_path: Path, *extra: str) -> None:
        self.tmp = tmp_path
        port_file = tmp_path / "port"
        self._out = (tmp_path / "stdout").open("w")
        self._err = (tmp_path / "stderr").open("w")
        cmd = [sys.executable, "-m", "jaxlab", "serve", "--run-dir", str(run_dir)]
        cmd += ["--port", "0", "--port-file", str(port_file), *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=self._err, env=clean_env(), cwd=ROOT
        )
        t_end = time.monotonic() + 600  # start-up on a loaded 2-core VM
        while not port_file.exists():
            assert self.proc.poll() is None, self.stderr
            assert time.monotonic() < t_end
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_statuses: list[int] = []
        while True:
            try:
                self.ready_statuses.append(httpx.get(self.url + "/ready", timeout=5).status_code)
            except httpx.TransportError:
                self.ready_statuses.append(0)
            if self.ready_statuses[-1] == 200:
                break
            assert self.proc.poll() is None and time.monotonic() < t_end, self.stderr
            time.sleep(0.1)

    @property
    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return (self.tmp / "stderr").read_text()

    @property
    def stdout(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return (self.tmp / "stdout").read_text()

    def wait_for(self, path: str, status: int) -> None:
        wait_until(lambda: httpx.get(self.url + path).status_code == status)

    def listening(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=1)
        except httpx.TransportError:
            return False
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._err.close()


@pytest.mark.slow
def test_sigterm_drains_an_in_flight_request_then_exits_0(run_dir, tmp_path):
    srv = Served(run_dir, tmp_path, *ONE_BUCKET, "--set", "serve.drain_timeout_s=30", "--json")
    proc, url, port = srv.proc, srv.url, srv.port
    try:
        assert 503 in srv.ready_statuses  # gated while loading and warming

        body = {"prompt": "in flight", "max_tokens": 48, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            first = next(lines)
            assert first.startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            srv.wait_for("/ready", 503)
            late = httpx.post(url + "/v1/generate", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and "Retry-After" in late.headers
            assert late.json()["error"]["code"] == "draining"
            rest = list(lines)
        payloads = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
        assert [x for x in rest if x][-1] == "data: [DONE]"
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        srv.close()
    stderr = srv.stderr
    assert f"listening on {url}" in stderr
    assert f"ready: {url}" in stderr
    assert "SIGTERM: drained" in stderr
    assert "Traceback" not in stderr
    doc = json.loads(srv.stdout)
    assert doc["port"] == port and doc["url"] == url and doc["checkpoint_step"] == RUN_STEPS
    # One bucket, for chunks from a prompt's start and past it (chunked prefill and prefix
    # caching are on by default), in calls of 1, 2 and 4 rows (serve.prefill_batch = 4 slots);
    # a decode chunk per staged length of the 128-token cache (64, 96 and 128 positions).
    assert doc["compiles"]["prefill"] == 2 * 3 and doc["compiles"]["generate"] == 3


@pytest.mark.slow
def test_a_second_sigterm_cuts_a_drain_short_but_not_a_finished_one(run_dir, tmp_path):
    # During a drain: the in-flight request is cut off (an error event), exit 143, and no
    # traceback.
    (tmp_path / "a").mkdir()
    srv = Served(run_dir, tmp_path / "a", *ONE_BUCKET, "--set", "serve.drain_timeout_s=60")
    try:
        body = {"prompt": "in flight", "max_tokens": 48, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: {")
            srv.proc.send_signal(signal.SIGTERM)
            srv.wait_for("/ready", 503)
            srv.proc.send_signal(signal.SIGTERM)
            assert srv.proc.wait(timeout=30) == 143
            rest = list(lines)
        # The cut-off request learns why, in the stream: an OpenAI-shaped error event.
        errors = [json.loads(x[6:])["error"] for x in rest if x.startswith('data: {"error"')]
        assert [e["code"] for e in errors] == ["shutting_down"]
    finally:
        srv.close()
    assert "SIGTERM: stopped (drain incomplete)" in srv.stderr, srv.stderr
    assert "Traceback" not in srv.stderr, srv.stderr

    # After the drain (an idle server drains at once; the socket closes when uvicorn starts
    # shutting down): the second signal changes nothing, exit 0.
    (tmp_path / "b").mkdir()
    srv = Served(run_dir, tmp_path / "b", *ONE_BUCKET)
    try:
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: not srv.listening(), timeout_s=30)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.close()
    assert "SIGTERM: drained" in srv.stderr, srv.stderr
    assert "Traceback" not in srv.stderr, srv.stderr
