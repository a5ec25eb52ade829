"""The checkpoint layer on damaged steps: real Orbax in a temp dir, a small synthetic state.

Every way of damaging the newest step makes ``restore_intact`` fall back to the step before
it, bitwise; an explicit damaged step is an error; an intact step that does not fit the
target is a mismatch, never a fallback.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from ckpt_damage import DAMAGE, flip_bytes_everywhere

from jaxlab.checkpoint import (
    Checkpointer,
    CheckpointMismatch,
    CheckpointUnreadable,
    NoIntactCheckpoint,
)
from jaxlab.train.step import abstract_like

STEPS = (1, 2, 3)


def state_at(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(48), jnp.float32),
        },
        "opt_state": {"mu": jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)},
        "step": jnp.asarray(step, jnp.int32),
    }


def meta_at(step: int) -> dict:
    return {"config": "x = 1", "step": step}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three synchronous saves, made once; each test damages its own copy."""
    path = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    with Checkpointer(path, every_steps=1, keep_last=5, async_save=False) as ck:
        for s in STEPS:
            assert ck.save(s, state_at(s), meta_at(s))
    return path


@pytest.fixture
def ckdir(saved: Path, tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    shutil.copytree(saved, path)
    return path


def same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def target() -> dict:
    return abstract_like(state_at(0))


def params_target() -> dict:
    return {"params": abstract_like(state_at(0)["params"])}


def test_intact_checkpoints_restore_verified(ckdir):
    with Checkpointer(ckdir, read_only=True) as ck:
        assert ck.steps() == list(STEPS)
        got = ck.restore_intact("latest", lambda s: ck.restore(s, target()))
        assert got.step == 3 and got.skipped == () and got.note is None
        state, meta = got.value
        assert same(state, state_at(3)) and meta["step"] == 3
        assert set(meta["checksums"]["arrays"]) == {
            "params/w",
            "params/b",
            "opt_state/mu",
            "step",
        }
        assert same(ck.restore_subset(2, params_target()), {"params": state_at(2)["params"]})
        assert same(ck.restore(1, None)[0], state_at(1))  # as saved, no target


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_latest_falls_back_to_the_step_before(ckdir, kind):
    DAMAGE[kind](ckdir / "3")
    with Checkpointer(ckdir, read_only=True) as ck:
        assert 3 in ck.steps()  # still listed: it is there, and unreadable
        got = ck.restore_intact(None, lambda s: ck.restore(s, target()))
        assert got.step == 2 and [k.step for k in got.skipped] == [3]
        assert same(got.value[0], state_at(2))
        assert got.note is not None and got.note.startswith("checkpoint step 3 is unreadable (")
        assert got.note.endswith("); using step 2") and "\n" not in got.note
        assert len(got.note) < 300
        # The params-only restore of inference falls back the same way.
        sub = ck.restore_intact(None, lambda s: ck.restore_subset(s, params_target()))
        assert sub.step == 2 and same(sub.value, {"params": state_at(2)["params"]})
        # An explicit step means exactly that step.
        with pytest.raises(CheckpointUnreadable, match=r"checkpoint step 3 is unreadable \(") as e:
            ck.restore_intact(3, lambda s: ck.restore(s, target()))
        assert "restore another step (1, 2) or the latest" in str(e.value)
        assert e.value.step == 3


def test_every_step_damaged_is_one_clear_error(ckdir):
    for s in STEPS:
        DAMAGE["truncate-array-file"](ckdir / str(s))
    with Checkpointer(ckdir, read_only=True) as ck, pytest.raises(NoIntactCheckpoint) as e:
        ck.restore_intact("latest", lambda s: ck.restore(s, target()))
    message = str(e.value)
    assert all(f"checkpoint step {s} is unreadable" in message for s in STEPS)
    assert "\n" not in message


def test_values_that_orbax_reads_back_changed_are_caught_by_the_checksum(ckdir, tmp_path):
    """Silent corruption: step 3's array data replaced by a well-formed copy with one bit of
    ``params/w`` flipped, so every file parses and reads back, as other values. Orbax
    restores it without complaint; the checksums catch it, in the full restore and in the
    params-only one of inference."""
    bad = state_at(3)
    w = np.asarray(bad["params"]["w"]).copy()
    w.view(np.uint32)[5, 7] ^= 1 << 20
    bad["params"]["w"] = jnp.asarray(w)
    with Checkpointer(tmp_path / "other", async_save=False) as other:
        other.save(3, bad, meta_at(3), force=True)
    shutil.rmtree(ckdir / "3" / "state")
    shutil.copytree(tmp_path / "other" / "3" / "state", ckdir / "3" / "state")
    plain = ocp.CheckpointManager(ckdir, item_names=("state", "meta"))
    try:
        out = plain.restore(3, args=ocp.args.Composite(state=ocp.args.StandardRestore(target())))
    finally:
        plain.close()
    assert same(out["state"], bad) and not same(out["state"], state_at(3))
    with Checkpointer(ckdir, read_only=True) as ck:
        with pytest.raises(CheckpointUnreadable, match="checksum mismatch in params/w"):
            ck.restore(3, target())
        with pytest.raises(CheckpointUnreadable, match="checksum mismatch in params/w"):
            ck.restore_subset(3, params_target())
        # What a restore does not read is not its concern: the optimizer state is intact.
        opt = {"opt_state": target()["opt_state"]}
        assert same(ck.restore_subset(3, opt), {"opt_state": state_at(3)["opt_state"]})


def test_bytes_flipped_on_disk_are_caught(ckdir):
    """The same, on disk: every array file with bytes flipped all over. Some reads fail,
    some read back other values; either way the step is unreadable, never silently used."""
    flip_bytes_everywhere(ckdir / "3")
    with Checkpointer(ckdir, read_only=True) as ck:
        with pytest.raises(CheckpointUnreadable):
            ck.restore(3, target())
        with pytest.raises(CheckpointUnreadable):
            ck.restore_subset(3, params_target())


def test_a_target_that_does_not_fit_is_a_mismatch_not_damage(ckdir):
    wrong = target()
    wrong["params"]["w"] = jax.ShapeDtypeStruct((32, 48), jnp.float32)
    fits = r"params/w was saved as float32\[64, 48\]"
    with Checkpointer(ckdir, read_only=True) as ck, pytest.raises(CheckpointMismatch, match=fits):
        ck.restore_intact("latest", lambda s: ck.restore(s, wrong))


def test_checkpoints_saved_without_checksums_still_restore(tmp_path):
    path = tmp_path / "checkpoints"
    plain = ocp.CheckpointManager(path, item_names=("state", "meta"))
    plain.save(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state_at(1)), meta=ocp.args.JsonSave(meta_at(1))
        ),
    )
    plain.wait_until_finished()
    plain.close()
    with Checkpointer(path, read_only=True) as ck:
        state, meta = ck.restore("latest", target())
    assert same(state, state_at(1)) and "checksums" not in meta


def test_set_aside_moves_a_damaged_step_out_of_the_way_of_new_saves(ckdir):
    DAMAGE["delete-commit-record"](ckdir / "3")
    with Checkpointer(ckdir, every_steps=1, keep_last=5, async_save=False) as ck:
        got = ck.restore_intact("latest", lambda s: ck.restore(s, target()))
        assert got.step == 2
        moved = ck.set_aside([k.step for k in got.skipped])
        assert moved == [ckdir / "unreadable" / "3"] and (moved[0] / "state").is_dir()
        ck.reload()
        assert ck.steps() == [1, 2]
        assert ck.save(3, state_at(3), meta_at(3))
        ck.wait()
        assert ck.steps() == [1, 2, 3]
        assert same(ck.restore(3, target())[0], state_at(3))


def test_a_writer_deletes_interrupted_saves_before_it_returns(ckdir):
    """Orbax deletes the temporary directory a killed save left in a background thread; a
    process that fails right after (a resume with nothing to restore) used to exit under it,
    and the thread died with a traceback. The Checkpointer waits for it instead."""
    tmp = ckdir / "4.orbax-checkpoint-tmp"
    (tmp / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")
    ck = Checkpointer(ckdir, every_steps=1)
    try:
        assert not tmp.exists()
        assert not [t for t in threading.enumerate() if type(t).__name__ == "_SignalingThread"]
    finally:
        ck.close()
    ck.close()  # twice is fine


def test_an_abandoned_orbax_read_task_is_logged_at_debug_only(caplog):
    """asyncio reports a collected task whose exception nobody retrieved at ERROR, spec and
    all; after a failed checkpoint read those are Orbax's abandoned reads: debug only. Any
    other never-retrieved exception is still reported."""
    import logging

    from jaxlab.checkpoint import manager

    manager._report_read_leftovers_quietly()
    asyncio_log = logging.getLogger("asyncio")
    with caplog.at_level(logging.DEBUG):
        asyncio_log.error(
            "Task exception was never retrieved\nfuture: <Task finished coro=<_read() "
            "at .../orbax/checkpoint/serialization.py:1> exception=ValueError('spec')>"
        )
        asyncio_log.error("Task exception was never retrieved\nfuture: <Task coro=<mine()>>")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage().splitlines()[1] for r in errors] == ["future: <Task coro=<mine()>>"]
    assert any("after a failed checkpoint read" in r.getMessage() for r in caplog.records)
