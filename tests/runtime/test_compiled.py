"""How a recompile is reported: one line naming the function, what changed and the time; a
WARNING only when nothing said new shapes were expected; the signature at DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import jax.numpy as jnp
import pytest

from jaxlab.runtime.compiled import ShapeKeyedJit, new_shapes_expected

LOGGER = "jaxlab.compile"


def step(state, batch):
    return state + batch["tokens"].sum()


def two_shapes(f: ShapeKeyedJit) -> None:
    f(jnp.zeros(()), {"tokens": jnp.ones((2, 8)), "mask": jnp.ones((2, 8))})
    f(jnp.zeros(()), {"tokens": jnp.ones((4, 8)), "mask": jnp.ones((2, 8))})


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    yield caplog


def at(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """This test's messages of ``level`` from the compile logger."""
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_an_unexpected_recompile_is_one_warning_line(records):
    f = ShapeKeyedJit(step, name="step")
    two_shapes(f)
    assert f.compiles == 2
    (line,) = at(records, logging.WARNING)
    assert "\n" not in line
    assert line.startswith("step recompiled (compile #2, ")
    assert line.endswith("s): batch['tokens'] shape (2, 8) -> (4, 8)")
    (sig,) = at(records, logging.DEBUG)  # the whole input signature, for --debug
    assert sig.startswith("step input signature: ") and "float32[4, 8]" in sig


def test_what_changed_counts_the_other_inputs(records):
    f = ShapeKeyedJit(step, name="step")
    f(jnp.zeros(()), {"tokens": jnp.ones((2, 8)), "mask": jnp.ones((2, 8))})
    f(jnp.zeros(()), {"tokens": jnp.ones((4, 8)), "mask": jnp.ones((4, 8))})
    f(jnp.zeros((), jnp.int32), {"tokens": jnp.ones((4, 8)), "mask": jnp.ones((4, 8))})
    first, second = at(records, logging.WARNING)
    assert first.endswith("batch['mask'] shape (2, 8) -> (4, 8) (and 1 more input)")
    assert second.endswith("state dtype float32 -> int32")  # the closest earlier signature


def test_expected_recompiles_are_not_warnings(records):
    with new_shapes_expected():
        two_shapes(ShapeKeyedJit(step, name="sweep"))
    assert not at(records, logging.WARNING)
    (line,) = at(records, logging.INFO)
    assert line.startswith("sweep recompiled")
    two_shapes(ShapeKeyedJit(step, name="by_design", warn_on_recompile=False))
    assert not at(records, logging.WARNING)
    assert any(m.startswith("by_design recompiled") for m in at(records, logging.DEBUG))


def test_after_the_block_recompiles_warn_again(records):
    with new_shapes_expected():
        pass
    two_shapes(ShapeKeyedJit(step, name="later"))
    assert len(at(records, logging.WARNING)) == 1


def test_benchmark_suites_that_sweep_shapes_say_so():
    from jaxlab.bench.suites import load_builtin_suites

    suites = load_builtin_suites()
    for name in ("decode", "kv-cache", "prefill", "train", "peer", "serve"):
        assert suites[name].new_shapes, name
    assert not suites["checkpoint"].new_shapes
