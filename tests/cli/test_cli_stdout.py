"""stdout holds only what the CLI means to print, whatever native code writes to fd 1."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import ROOT, clean_env, run_cli

NATIVE_NOISE = textwrap.dedent(
    """
    import os, subprocess, sys
    from jaxlab.cli.common import emit_json, reserve_stdout

    reserve_stdout()
    os.write(1, b"[native] written to fd 1\\n")  # as C/C++ code does, past sys.stdout
    subprocess.run(["sh", "-c", "echo child process stdout"], check=True)
    print("python print", flush=True)
    emit_json({"ok": True})
    os.write(1, b"[native] again\\n")
    """
)


def test_native_writes_to_fd_1_go_to_stderr():
    r = subprocess.run(
        [sys.executable, "-c", NATIVE_NOISE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == 'python print\n{\n  "ok": true\n}\n'
    for line in ("[native] written to fd 1", "child process stdout", "[native] again"):
        assert line in r.stderr


def test_help_json_and_toml_still_reach_stdout():
    assert "Usage: jaxlab" in run_cli("--help").stdout
    assert run_cli("config", "show", "-c", "tiny", "--json").json()["config"]["model"]
    assert "[model]" in run_cli("config", "show", "-c", "tiny").stdout
