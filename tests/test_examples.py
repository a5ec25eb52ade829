"""The scripts under examples/ run as a user runs them: a subprocess each.

``train_and_generate.py`` trains a tiny model and generates through the library API;
``openai_client.py`` and ``openai_chat.py`` then talk to one real server on that run with
the official ``openai`` client (a completion with a stop string and usage, then an SSE
stream; a chat answer with usage, then a streamed chat).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

pytestmark = pytest.mark.slow


def run_example(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=str(ROOT),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run_dir = tmp_path_factory.mktemp("example") / "run"
    proc = run_example("train_and_generate.py", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    return run_dir, proc.stdout


def test_train_and_generate_through_the_library(trained):
    run_dir, out = trained
    lines = out.splitlines()
    assert lines[0].startswith("trained 150 steps: loss ")
    assert len(lines) == 4 and lines[1].startswith("'") and lines[2].startswith("'")
    compiles = ast.literal_eval(lines[3].removeprefix("compiles: "))
    assert compiles == {
        "prefill": 1,
        "first_token": 1,
        "insert": 1,
        "init_decode_state": 1,
        "generate": 1,
    }
    assert (run_dir / "checkpoints" / "150").is_dir()
    assert (run_dir / "metrics.jsonl").is_file()


@pytest.fixture(scope="module")
def server_url(trained: tuple[Path, str]) -> Iterator[str]:
    """A real server (uvicorn on an ephemeral port) on the example's run, for both clients."""
    from jaxlab.serve import ModelService, ServerThread, serve_config

    run_dir, _ = trained
    # One slot (the clients send one request at a time) and one prefill length (every
    # prompt of the examples is under 32 tokens): a warm-up of a few shapes, not dozens.
    sets = ["serve.port=0", "serve.slots=1"]
    sets += ["inference.prefill_buckets=[32]", "serve.prefill_chunk_tokens=32"]
    cfg = serve_config(run_dir, sets, environ={})
    srv = ServerThread(ModelService.from_run_dir(cfg, run_dir)).start()
    try:
        srv.wait_ready(timeout_s=300)
        yield srv.url + "/v1"
    finally:
        srv.stop()


def test_openai_client_against_jaxlab_serve(server_url):
    proc = run_example("openai_client.py", server_url)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "model: jaxlab"
    assert lines[1].startswith("completion (stop): ") or lines[1].startswith("completion (length)")
    assert lines[2].startswith("usage: 5 prompt + ")
    assert lines[3].startswith("stream: ")


def test_openai_chat_example_against_jaxlab_serve(server_url):
    proc = run_example("openai_chat.py", server_url)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert re.fullmatch(r"chat \((stop|length)\): assistant: '.*'", lines[0]), lines[0]
    # <|system|>You count.<|end|><|user|>count: 3 4 5<|end|><|assistant|>: 5 special tokens
    # and at most 22 for the 22 bytes of text (merges only shorten it).
    prompt, generated = map(int, re.findall(r"\d+", lines[1]))
    assert lines[1].startswith("usage: ") and 5 < prompt <= 5 + 22 and 0 <= generated <= 24
    assert lines[2].startswith("stream: ")
