"""A local Debian base image for the Containerfile, made where no image registry is reachable.

``debootstrap --variant=minbase`` makes a bookworm root filesystem with python3 (and venv, pip
and CA certificates) from the Debian mirror apt already uses here. ``python`` is linked to
``python3`` and the EXTERNALLY-MANAGED marker removed, because the Containerfile pip-installs
pdm into the base interpreter as it does on ``python:3.11-slim``. ``podman import`` makes the
tree an image.

The image's tag is a hash of this recipe and the mirror, so podman's own image store is the
cache: a later run with the same recipe reuses the image (about a minute saved), and a changed
recipe makes a new one. It does not touch other images.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

SUITE = "bookworm"  # Python 3.11, as the Containerfile's default python:3.11-slim
PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
#: Bump when the steps below change what the image holds (it is part of the cache key).
RECIPE_VERSION = 1
FALLBACK_MIRROR = "http://deb.debian.org/debian"


def apt_mirror(suite: str = SUITE, apt_dir: Path = Path("/etc/apt")) -> str:
    """The first mirror in apt's sources (one-line ``.list`` or deb822 ``.sources``) that
    serves ``suite``; the Debian CDN when none does."""
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields = _deb822_fields(stanza)
                if (
                    "deb" in fields.get("types", "").split()
                    and suite in fields.get("suites", "").split()
                ):
                    return fields["uris"].split()[0]
        elif path.suffix == ".list" or path.name == "sources.list":
            for line in text.splitlines():
                # deb [options] URI SUITE COMPONENT...
                words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                    return words[1]
    return FALLBACK_MIRROR


def _deb822_fields(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    key = None
    for line in stanza.splitlines():
        if line.startswith("#"):
            continue
        if line[:1] in (" ", "\t") and key:
            fields[key] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
    return fields


def base_image_tag(mirror: str) -> str:
    key = json.dumps([RECIPE_VERSION, SUITE, PACKAGES, mirror]).encode()
    return f"localhost/jaxlab-test-base:{hashlib.sha256(key).hexdigest()[:12]}"


def local_base_image(podman: str) -> str:
    """The tag of the local base image, made now unless this recipe's image already exists."""
    mirror = apt_mirror()
    tag = base_image_tag(mirror)
    if subprocess.run([podman, "image", "exists", tag]).returncode == 0:
        return tag
    workdir = Path(tempfile.mkdtemp(prefix="jaxlab-test-rootfs-"))
    rootfs = workdir / "rootfs"
    try:
        _run(
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(rootfs),
            mirror,
            timeout=1200,
        )
        (rootfs / "usr/bin/python").symlink_to("python3")
        for marker in rootfs.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        # The downloaded packages and apt's indexes: a third of the tree, and no build step
        # installs from apt.
        for leftover in [
            *rootfs.glob("var/cache/apt/archives/*.deb"),
            *rootfs.glob("var/lib/apt/lists/*_*"),
        ]:
            leftover.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            imported = subprocess.run(
                [podman, "import", "-", tag], stdin=tar.stdout, capture_output=True, timeout=600
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        assert tar.returncode == 0 and imported.returncode == 0, imported.stderr.decode()[-2000:]
    finally:
        _remove_tree(workdir)
    return tag


def _run(*argv: str, timeout: float) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-3000:]}"


def _remove_tree(path: Path) -> None:
    """Remove ``path``, but never through a mount: debootstrap mounts /proc (and may bind
    /dev) inside the tree while it works, and a failure could leave one behind."""
    resolved = str(path.resolve())
    with open("/proc/self/mounts") as f:
        mounted = [
            line.split()[1]
            for line in f
            if line.split()[1] == resolved or line.split()[1].startswith(resolved + "/")
        ]
    for mountpoint in sorted(mounted, reverse=True):
        subprocess.run(["umount", "--lazy", mountpoint], check=False)
    with open("/proc/self/mounts") as f:
        left = [line.split()[1] for line in f if line.split()[1].startswith(resolved + "/")]
    assert not left, f"still mounted under {path}: {left}; not removing it"
    shutil.rmtree(path)
