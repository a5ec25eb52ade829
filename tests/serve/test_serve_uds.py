"""Serving over a unix socket: a real uvicorn on a socket in a temp dir, ``jaxlab serve --uds``
as a user runs it, and ``jaxlab bench serve --url unix:PATH`` loading such a server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, clean_env, run_cli, tiny_run_dir

from jaxlab.bench.record import load_records
from jaxlab.serve.loadgen import closed_loop, completion_bodies, completions_url, make_prompts
from jaxlab.serve.server import bind_unix_socket, unix_url

SETS = [
    "inference.max_len=64",
    "inference.max_new_tokens=16",
    "inference.prefill_buckets=[64]",
    "serve.slots=4",
    "serve.max_queue=512",
    "serve.max_tokens_limit=16",
]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: a unix socket's path must fit in 108 bytes."""
    d = Path(tempfile.mkdtemp(prefix="jx-uds-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def client(path: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://jaxlab")


def test_a_socket_file_nobody_serves_is_replaced_others_are_refused(short_dir):
    path = short_dir / "s.sock"
    live = bind_unix_socket(path)
    live.listen()
    with pytest.raises(OSError, match="already listening"):
        bind_unix_socket(path)
    live.close()  # closed without unlinking: the file stays, nobody answers on it
    assert path.exists()
    again = bind_unix_socket(path)
    assert again.family == socket.AF_UNIX
    again.close()
    other = short_dir / "plain"
    other.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix_socket(other)
    assert other.read_text() == "not a socket"
    assert unix_url(path) == f"unix:{path}"
    assert completions_url(unix_url(path)) == "http://localhost/v1/completions"


def test_serve_uds_usage_errors_exit_2(tmp_path):
    r = run_cli("serve", "--run-dir", str(tmp_path), "--uds", str(tmp_path / "s"), "--port", "1")
    assert r.returncode == 2 and "--uds" in r.stderr and "drop --port" in r.stderr
    r = run_cli("serve", "--run-dir", str(tmp_path), "--uds", str(tmp_path / "no" / "s"))
    assert r.returncode == 2 and "no such directory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def uds_server():
    """A ready in-process server on a unix socket in a temp dir (a random bench-tiny model)."""
    from jaxlab.config import load_config
    from jaxlab.infer import Engine
    from jaxlab.serve import ModelService, ServerThread
    from jaxlab.tokenizer import byte_tokenizer

    cfg = load_config("bench-tiny", SETS, environ={})
    service = ModelService.from_engine(Engine.from_config(cfg, seed=0), byte_tokenizer(), cfg)
    where = Path(tempfile.mkdtemp(prefix="jx-uds-"))
    path = where / "serve.sock"
    srv = ServerThread(service, uds=path).start()
    try:
        srv.wait_ready()
        yield srv, path, service
    finally:
        srv.stop()
        assert not path.exists(), "the server removes its socket file"
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.slow
def test_uvicorn_on_a_unix_socket_serves_requests(uds_server):
    srv, path, _ = uds_server
    assert srv.url == f"unix:{path}" and srv.port == 0
    with client(path) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["usage"]["completion_tokens"] == 5 and doc["choices"][0]["finish_reason"]
    # The load generator reaches it through aiohttp's UnixConnector.
    bodies = completion_bodies(make_prompts(6, 8), 4, temperature=0.0)
    load = closed_loop(srv.url, bodies, 3)
    assert load.errors == 0 and len(load.ok) == 6 and load.output_tokens == 24


@pytest.mark.slow
def test_bench_serve_loads_a_server_on_a_unix_socket(uds_server, tmp_path):
    """``jaxlab bench serve --url unix:PATH``: the sweep and Poisson cases against it, and
    every request of them answered by it (its own request counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    srv, _, service = uds_server

    def served() -> float:
        return sum(
            s.value
            for fam in text_string_to_metric_families(service.metrics.render().decode())
            for s in fam.samples
            if s.name == "jaxlab_requests_total" and s.labels == {"status": "200"}
        )

    def settled() -> float:
        """The counter once it has stopped moving: a response is counted after its last
        byte is sent, so the client may have its answer before the count moves."""
        value, deadline = served(), time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = served()
            if now == value:
                break
            value = now
        return value

    before = settled()
    args = ["bench", "serve", "--quick", "--config", "bench-tiny"]
    args += [x for s in SETS for x in ("--set", s)]
    r = run_cli(*args, "--url", srv.url, "--out", str(tmp_path), "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    records = load_records(Path(r.json()["out_dir"]))
    e2e = [x for x in records if x.metric == "e2e_s"]
    assert {x.case["mode"] for x in e2e} == {"closed", "poisson"}
    assert all(x.case["slots"] == "external" and x.status == "ok" for x in e2e)
    assert all(x.derived["errors"] == 0 for x in e2e)
    assert settled() - before == sum(x.derived["requests"] for x in e2e)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run_dir(tmp_path_factory)  # trained once per session, shared


@pytest.mark.slow
def test_jaxlab_serve_uds_serves_then_drains_and_removes_its_socket(run_dir, short_dir):
    path = short_dir / "jaxlab.sock"
    out, err = (short_dir / "stdout").open("w"), (short_dir / "stderr").open("w")
    cmd = [sys.executable, "-m", "jaxlab", "serve", "--run-dir", str(run_dir), "--uds", str(path)]
    # One slot and one prefill length (the prompt is under 16 tokens): the socket, the readiness,
    # the drain and the socket's removal are what is tested, not the warm-up's many shapes.
    cmd += ["--slots", "1", "--set", "inference.prefill_buckets=[16]"]
    cmd += ["--set", "serve.prefill_chunk_tokens=16"]
    proc = subprocess.Popen([*cmd, "--json"], stdout=out, stderr=err, env=clean_env(), cwd=ROOT)
    try:
        t_end = time.monotonic() + 600  # start-up on a loaded 2-core VM
        while True:
            assert proc.poll() is None, (short_dir / "stderr").read_text()
            assert time.monotonic() < t_end
            if path.exists():
                try:
                    with client(path) as c:
                        if c.get("/ready").status_code == 200:
                            break
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        with client(path) as c:
            body = {"prompt": "over a socket", "max_tokens": 4, "temperature": 0.0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()
    stderr = (short_dir / "stderr").read_text()
    assert f"listening on unix:{path}" in stderr and f"ready: unix:{path}" in stderr
    assert "SIGTERM: drained" in stderr and "Traceback" not in stderr
    doc = json.loads((short_dir / "stdout").read_text())
    assert doc["url"] == f"unix:{path}" and doc["uds"] == str(path) and "port" not in doc
    assert not os.path.exists(path), "the socket file is removed on exit"
