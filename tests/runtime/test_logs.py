"""``quiet_absl`` holds absl's (Orbax's) log back for a block, unless DEBUG was asked for."""

from __future__ import annotations

import logging

import pytest

from jaxlab.runtime.logs import quiet_absl


@pytest.fixture
def absl():
    logger = logging.getLogger("absl")
    old = logger.level
    yield logger
    logger.setLevel(old)


def test_the_block_runs_at_the_given_level_and_the_old_level_comes_back(absl) -> None:
    absl.setLevel(logging.INFO)
    with quiet_absl():
        assert absl.level == logging.ERROR
    assert absl.level == logging.INFO
    with quiet_absl(logging.CRITICAL):
        assert absl.level == logging.CRITICAL
    assert absl.level == logging.INFO


def test_the_old_level_comes_back_when_the_block_raises(absl) -> None:
    absl.setLevel(logging.WARNING)
    with pytest.raises(RuntimeError), quiet_absl():
        raise RuntimeError("boom")
    assert absl.level == logging.WARNING


def test_debug_sees_everything(absl, caplog) -> None:
    absl.setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG, logger="absl"), quiet_absl():
        assert absl.level == logging.DEBUG
        absl.warning("read-only manager ignores save options")
    assert "ignores save options" in caplog.text
