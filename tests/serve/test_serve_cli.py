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
from conftest import ROOT, clean_env, run_cli
from test_serve_api import RUN_STEPS, train_tiny


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The same session directory as test_serve_api's fixture: trained once per session.
    path = tmp_path_factory.getbasetemp() / "serve-run"
    if not (path / "checkpoints" / str(RUN_STEPS)).is_dir():
        train_tiny(path)
    return path


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


@pytest.mark.slow
def test_sigterm_drains_an_in_flight_request_then_exits_0(run_dir, tmp_path):
    port_file = tmp_path / "port"
    out, err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    cmd = [
        sys.executable,
        "-m",
        "jaxlab",
        "serve",
        "--run-dir",
        str(run_dir),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--set",
        "inference.prefill_buckets=[128]",
        "--set",
        "serve.drain_timeout_s=30",
        "--chunk-delay-s",
        "0.25",  # 48 tokens take >= 1.5 s: the request is surely in flight at SIGTERM
        "--json",
    ]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=clean_env(), cwd=ROOT)
    try:
        t_end = time.monotonic() + 180
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < t_end
            time.sleep(0.05)
        port = int(port_file.read_text())
        url = f"http://127.0.0.1:{port}"
        statuses = []
        while True:
            try:
                statuses.append(httpx.get(url + "/ready", timeout=5).status_code)
            except httpx.TransportError:
                statuses.append(0)
            if statuses[-1] == 200:
                break
            assert proc.poll() is None and time.monotonic() < t_end
            time.sleep(0.1)
        assert 503 in statuses  # gated while loading and warming

        body = {"prompt": "in flight", "max_tokens": 48, "temperature": 0.0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            lines = s.iter_lines()
            first = next(lines)
            assert first.startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            late = httpx.post(url + "/v1/generate", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and "Retry-After" in late.headers
            assert late.json()["error"]["code"] == "draining"
            rest = list(lines)
        payloads = [json.loads(x[6:]) for x in [first, *rest] if x.startswith("data: {")]
        assert [x for x in rest if x][-1] == "data: [DONE]"
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    stderr = (tmp_path / "stderr").read_text()
    assert f"listening on {url}" in stderr
    assert f"ready: {url}" in stderr
    assert "SIGTERM: drained" in stderr
    doc = json.loads((tmp_path / "stdout").read_text())
    assert doc["port"] == port and doc["url"] == url and doc["checkpoint_step"] == RUN_STEPS
    # One bucket, prefilled in admission groups of 1, 2 and 4 (serve.prefill_batch = 4 slots).
    assert doc["compiles"]["prefill"] == 3 and doc["compiles"]["decode"] == 1
