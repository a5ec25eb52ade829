"""Build the repository's Containerfile with podman, and read back what the image declares.

The build runs with the adjustments these machines need and that are harmless elsewhere:
``--isolation=chroot`` (their cgroup setup refuses the OCI runtime inside a build),
``--network host``, and the host's CA bundle mounted over the image's (TLS to the package index
goes through it). ``--format docker`` keeps the HEALTHCHECK, which the OCI format drops.

Podman's layer cache makes a rebuild with unchanged inputs take seconds, and rebuilds only the
changed layers otherwise (the 670 MB of locked dependencies only when pdm.lock changes). The
test builds under a tag of its own and untags it afterwards, leaving the layers as cache; the
small layers of stale builds stay behind as untagged images (``podman image prune`` drops them).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

CONTAINERFILE = ROOT / "Containerfile"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


@dataclass(frozen=True)
class ImageSpec:
    """What an image declares about how it runs (``podman image inspect``)."""

    image_id: str
    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    user: str
    workdir: str
    healthcheck: list[str]  # ["CMD", argv...] or ["CMD-SHELL", command]; [] when none
    healthcheck_timeout_s: float
    size_bytes: int

    @property
    def argv(self) -> list[str]:
        return [*self.entrypoint, *self.cmd]


def build_image(podman: str, base_image: str | None, tag: str) -> ImageSpec:
    """Build the Containerfile as ``tag`` (on ``base_image``, or the Containerfile's default
    base when None) and return what the image declares."""
    argv = [podman, "build", "--format", "docker", "--isolation=chroot", "--network", "host"]
    if HOST_CA_BUNDLE.is_file():
        argv += ["-v", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"]
    if base_image is not None:
        argv += ["--build-arg", f"BASE_IMAGE={base_image}"]
    argv += ["-t", tag, "-f", str(CONTAINERFILE), str(ROOT)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"podman build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return inspect_image(podman, tag)


def inspect_image(podman: str, ref: str) -> ImageSpec:
    r = subprocess.run([podman, "image", "inspect", ref], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)[0]
    config = doc.get("Config") or {}
    health = doc.get("Healthcheck") or config.get("Healthcheck") or {}
    return ImageSpec(
        image_id=doc["Id"],
        entrypoint=list(config.get("Entrypoint") or []),
        cmd=list(config.get("Cmd") or []),
        env=dict(item.split("=", 1) for item in config.get("Env") or []),
        user=config.get("User") or "",
        workdir=config.get("WorkingDir") or "/",
        healthcheck=list(health.get("Test") or []),
        healthcheck_timeout_s=(health.get("Timeout") or 30_000_000_000) / 1e9,
        size_bytes=int(doc["Size"]),
    )


def run_dir_argument(argv: list[str]) -> str:
    """The path after ``--run-dir`` in the image's command line: where the run dir mounts."""
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--run-dir="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"the image's ENTRYPOINT + CMD names no --run-dir: {argv}")
