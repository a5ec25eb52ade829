"""Library log noise held back for a block of code: :func:`quiet_absl`.

Orbax logs through absl's logger, at WARNING and INFO, about things a caller may already
expect and report in its own words: a read-only manager ignoring its save options, or the
damaged steps a listing skips (which the checkpoint layer reports once, when it reads them).
The caller wraps that call in :func:`quiet_absl`. Whoever asked for DEBUG (absl's logger at
DEBUG or below) still sees everything. Importing this module does not import jax.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_absl(level: int = logging.ERROR) -> Iterator[None]:
    """absl's logger (Orbax's) at ``level`` for the block, then as it was; untouched when
    its effective level is DEBUG or below."""
    absl = logging.getLogger("absl")
    old = absl.level
    if absl.getEffectiveLevel() > logging.DEBUG:
        absl.setLevel(level)
    try:
        yield
    finally:
        absl.setLevel(old)


__all__ = ["quiet_absl"]
