"""The serving image, built and run for real: the Containerfile's image starts its declared
ENTRYPOINT + CMD, serves a trained run, passes its own HEALTHCHECK and runs as its user.

Needs podman: ``.ci/run`` installs it (and debootstrap) with apt-get where it runs as root, and
this test skips, saying why, where podman is missing. As root with debootstrap, the image is
built on a local Debian base (:mod:`container_base`, cached between runs in podman's image
store), elsewhere on the Containerfile's default base from a registry (:mod:`container_image`).
How it runs: ``podman run`` where that works, else the image's own filesystem as root
(:mod:`container_launch`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import tiny_run_dir
from container_base import local_base_image
from container_image import ImageSpec, build_image
from container_launch import launch, launch_mode

PODMAN = shutil.which("podman")
#: Settings passed as ``-e`` would pass them (the CMD stays as the image declares it): one slot,
#: one prefill bucket, whole prompts. The warm-up then compiles a handful of programs instead of
#: every bucket, row count and chunk kind; tests/serve/ covers those on the host.
ENV = {
    "JAXLAB_INFERENCE__PREFILL_BUCKETS": "[128]",
    "JAXLAB_SERVE__SLOTS": "1",
    "JAXLAB_SERVE__PREFILL_BATCH": "1",
    "JAXLAB_SERVE__PREFILL_CHUNK_TOKENS": "0",
    "JAXLAB_SERVE__PREFIX_CACHING": "false",
}
SERVICE_UID = 10001
#: Test and lint dependencies, and the optional plots extra: none belongs in the serving image.
NOT_IN_IMAGE = ("pytest", "hypothesis", "ruff", "openai", "matplotlib")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        PODMAN is None,
        reason="podman is not installed: .ci/run installs it (apt-get install podman"
        " debootstrap) only where it runs as root and apt-get exists",
    ),
]


@pytest.fixture(scope="module")
def image() -> Iterator[ImageSpec]:
    assert PODMAN
    local = os.geteuid() == 0 and shutil.which("debootstrap") is not None
    tag = f"localhost/jaxlab-test:{uuid.uuid4().hex[:12]}"
    try:
        yield build_image(PODMAN, local_base_image(PODMAN) if local else None, tag)
    finally:
        # Untag only: removing the image would also remove its cached layers.
        subprocess.run([PODMAN, "untag", tag, tag], capture_output=True)


def test_image_serves_a_trained_run_as_declared(image, tmp_path_factory, tmp_path):
    assert PODMAN
    assert image.entrypoint == ["jaxlab", "serve"] and image.healthcheck, image
    mode = launch_mode(PODMAN, image)
    if mode is None:
        pytest.skip("podman run does not work here, and running the image's filesystem needs root")
    run_dir = tiny_run_dir(tmp_path_factory)

    with launch(mode, PODMAN, image, run_dir, ENV, tmp_path) as server:
        server.wait_until_ready(timeout_s=300)
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
        body = {"model": "jaxlab", "prompt": "hello", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice, usage = r.json()["choices"][0], r.json()["usage"]
        assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
        assert 1 <= usage["completion_tokens"] <= 4

        assert server.healthcheck() == 0, server.output()[-3000:]

        status = server.exec(
            ["python", "-c", f"print(open('/proc/{server.server_pid}/status').read())"]
        )
        assert status.returncode == 0, status.stderr
        ids = {
            line.split(":")[0]: [int(x) for x in line.split()[1:]]
            for line in status.stdout.splitlines()
            if line.startswith(("Uid:", "Gid:", "Groups:"))
        }
        assert ids["Uid"] == [SERVICE_UID] * 4, ids  # real, effective, saved, filesystem
        assert 0 not in ids["Gid"] + ids["Groups"], ids

        # The interpreter on the image's PATH is the virtualenv's: the server's packages are
        # there, and no test, lint or plotting package.
        probe = (
            "import importlib.util as u, json, sys; "
            "print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))"
        )
        found = server.exec(["python", "-c", probe, "jaxlab", "jax", *NOT_IN_IMAGE])
        assert found.returncode == 0, found.stderr
        assert json.loads(found.stdout) == {
            "jaxlab": True,
            "jax": True,
            **dict.fromkeys(NOT_IN_IMAGE, False),
        }

        # SIGTERM, as `podman stop` sends it: an idle server drains and exits 0; after that
        # its HEALTHCHECK fails (it probes the server, not merely exits 0).
        assert server.stop(timeout_s=60) == 0, server.output()[-3000:]
        assert server.healthcheck() != 0
        output = server.output()
        assert "SIGTERM: drained" in output and "Traceback" not in output, output[-3000:]
