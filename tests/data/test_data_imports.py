"""The data package must stay numpy-only: importing it never pulls in jax."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_jax() -> None:
    code = "import sys, jaxlab.data; assert 'jax' not in sys.modules, 'jaxlab.data imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
