"""A thin, honest wrapper over ``orbax.checkpoint.CheckpointManager``.

Each checkpoint step directory holds two items:

- ``state``: the array pytree (params, optimizer state, step, PRNG key), written by
  Orbax's standard handler, sharded as it lives on the devices, and restored onto
  whatever sharding the caller's abstract target asks for (so a checkpoint saved on one
  mesh restores on another).
- ``meta``: JSON with the resolved config (TOML text), the tokenizer files and their
  sha256, so a checkpoint is self-contained, and ``checksums``: each array's shape, dtype
  and checksum (:mod:`jaxlab.checkpoint.checksum`) and a sha256 of the rest of ``meta``.

Atomicity is Orbax's: a step is written under a temporary name and renamed only when
every item is complete, and the manager lists finalized steps only, so a checkpoint
interrupted by SIGKILL mid-save is never picked up.

Damage after that (a file deleted, truncated or flipped on disk) is this module's: every
restore verifies what it read against the checksums, and any failure to read a step as it
was saved raises :class:`CheckpointUnreadable`. :meth:`Checkpointer.restore_intact` is the
one place that turns that into a fallback to the newest intact step. This module never
prints; callers say what was skipped.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import orbax.checkpoint as ocp

from jaxlab.checkpoint import checksum
from jaxlab.runtime.logs import quiet_absl

T = TypeVar("T")

log = logging.getLogger("jaxlab.checkpoint")

#: Where :meth:`Checkpointer.set_aside` moves unreadable steps (inside the checkpoint
#: directory; not a step name, so Orbax and :meth:`Checkpointer.steps` never list it).
UNREADABLE_DIR = "unreadable"

# JSON files Orbax writes into every committed step: its commit record and each item's
# metadata. A step where one is missing or does not parse is unreadable.
_REQUIRED_FILES = ("_CHECKPOINT_METADATA", "state/_METADATA", "meta/metadata")


class CheckpointNotFound(Exception):
    """No (such) finalized checkpoint in a directory."""


class CheckpointUnreadable(Exception):
    """A finalized checkpoint step that cannot be restored as it was saved: a file missing,
    truncated or unparsable, or an array whose checksum differs from the one recorded."""

    def __init__(self, step: int, reason: str, hint: str = ""):
        self.step = step
        self.reason = reason
        super().__init__(f"checkpoint step {step} is unreadable ({reason}){hint}")


class NoIntactCheckpoint(Exception):
    """Every finalized checkpoint in a directory is unreadable."""

    def __init__(self, directory: Path, skipped: tuple[Skipped, ...]):
        self.skipped = skipped
        listed = "; ".join(str(s) for s in skipped)
        super().__init__(
            f"no intact checkpoint in {directory}: {listed}; the run must start again "
            "(a new --run-dir) or be restored from a copy of its checkpoints"
        )


class CheckpointMismatch(ValueError):
    """An intact checkpoint that does not hold what the restore target expects (the config
    or the code changed since it was saved): not damage, so never a reason to fall back."""


@dataclass(frozen=True)
class Skipped:
    """A step passed over by :meth:`Checkpointer.restore_intact`, and why."""

    step: int
    reason: str

    def __str__(self) -> str:
        return f"checkpoint step {self.step} is unreadable ({self.reason})"


@dataclass(frozen=True)
class Restored(Generic[T]):
    """What :meth:`Checkpointer.restore_intact` read: the step, the value, what it skipped."""

    step: int
    value: T
    skipped: tuple[Skipped, ...] = ()

    @property
    def note(self) -> str | None:
        """One line naming the damaged steps skipped and the step used; None if none."""
        if not self.skipped:
            return None
        return "; ".join(str(s) for s in self.skipped) + f"; using step {self.step}"


def _one_line(e: BaseException, root: Path | None = None) -> str:
    """The innermost cause of a read failure as one short line: Orbax's wrappers, TensorStore's
    specs and driver chains dropped, paths under ``root`` made relative."""
    seen = [e]
    while (nxt := seen[-1].__cause__ or seen[-1].__context__) is not None and nxt not in seen:
        seen.append(nxt)
    inner = seen[-1]
    lines = str(inner).strip().splitlines()
    text = lines[0] if lines else ""
    text = re.sub(r"\s*\[[a-z_]+='.*?'\]", "", text)  # [tensorstore_spec='...'] and the like
    text = re.sub(r'Error opening "[^"]+" driver: ', "", text)
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)
    if root is not None:
        text = text.replace(f"{root}/", "")
    text = re.sub(r"\s*\{.*\}", "", text).strip()
    if not re.match(r"[A-Z_]+: ", text):  # TensorStore's status codes say enough
        text = f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    return text if len(text) <= 160 else text[:159] + "…"


def _orbax_listing() -> AbstractContextManager[None]:
    """Orbax logs (through absl) every step whose commit record is missing or damaged when it
    lists the steps; those steps are reported as unreadable here, once, when they are read.
    Its log stays visible at DEBUG."""
    return quiet_absl(logging.CRITICAL)


def _report_read_leftovers_quietly() -> None:
    """When a read fails, Orbax closes its event loop with TensorStore reads still in flight:
    their callbacks then find the loop closed, and the coroutines it abandoned raise when
    collected. Python reports each as an "unraisable" exception, a traceback on stderr, around
    or long after the failure itself. From the first checkpoint read on, those two kinds go to
    the debug log instead; every other unraisable exception is reported as before."""
    previous = sys.unraisablehook
    if getattr(previous, "jaxlab_quiet", False):
        return

    def hook(u: Any) -> None:
        exc, obj = u.exc_value, u.object
        loop_closed = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        code = getattr(obj, "cr_code", None)
        abandoned = code is not None and "orbax" in code.co_filename
        if loop_closed or abandoned:
            log.debug("after a failed checkpoint read: %s (%r)", exc, obj)
            return
        previous(u)

    hook.jaxlab_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    # The third kind: an abandoned read task whose exception nobody retrieved, which asyncio
    # logs (at ERROR, with TensorStore's whole spec) when the task is collected.
    logging.getLogger("asyncio").addFilter(_abandoned_orbax_tasks)


def _abandoned_orbax_tasks(record: logging.LogRecord) -> bool:
    msg = record.getMessage()
    if msg.startswith("Task exception was never retrieved") and "orbax" in msg:
        log.debug("after a failed checkpoint read: %s", msg.splitlines()[0])
        return False
    return True


def _all_processes_agree(ok: bool) -> bool:
    """True when every process read the step (a multi-process restore is all or none)."""
    import jax

    if jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array([ok], np.int32))))


class Checkpointer:
    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int = 100,
        keep_last: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self._closed = False
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every_steps,
            max_to_keep=keep_last,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        with _orbax_listing():
            self._manager = ocp.CheckpointManager(
                self.directory, item_names=("state", "meta"), options=options
            )
        # Orbax deletes the temporary directories of interrupted saves in a background thread,
        # whose file operations go through a thread pool. A process that ends soon after (a
        # resume that fails at once) would shut that pool down under it, and the thread dies
        # with a traceback. Wait for it here: with nothing in flight, nothing can outlive us.
        await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving ``state`` at ``step`` (async when enabled); True if a save started.

        Without ``force`` the manager's interval policy decides (every ``every_steps``).
        ``meta`` is saved with a ``checksums`` entry added. Every process must call it.
        """
        if step in self._manager.all_steps():
            return False
        if not force and not self._manager.should_save(step):
            return False
        # Checksums of the device arrays, before Orbax copies them to the host: the values
        # the save writes, whatever happens to the arrays afterwards.
        meta = {k: v for k, v in meta.items() if k != "checksums"}
        meta["checksums"] = {
            "scheme": checksum.SCHEME,
            "meta_sha256": checksum.meta_digest(meta),
            "arrays": checksum.array_checksums(state),
        }
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )

    def wait(self) -> None:
        """Block until any async save is durable on disk."""
        self._manager.wait_until_finished()

    # ------------------------------------------------------------------ query

    def steps(self) -> list[int]:
        """Finalized steps, oldest first: Orbax's list, and every step directory on disk
        (Orbax leaves out a step whose commit record is damaged; that step is still there,
        and unreadable)."""
        on_disk = (
            {int(p.name) for p in self.directory.iterdir() if p.is_dir() and p.name.isdigit()}
            if self.directory.is_dir()
            else set()
        )
        return sorted(set(self._manager.all_steps()) | on_disk)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def resolve_step(self, step: int | str | None) -> int:
        """'latest' / None -> the newest finalized step; an int must exist."""
        available = self.steps()
        if not available:
            raise CheckpointNotFound(f"no finalized checkpoint in {self.directory}")
        if step is None or step == "latest":
            return available[-1]
        step = int(step)
        if step not in available:
            raise CheckpointNotFound(
                f"no checkpoint for step {step} in {self.directory} (available: {available})"
            )
        return step

    def set_aside(self, steps: list[int]) -> list[Path]:
        """Move unreadable steps to ``unreadable/<step>`` beside the others, keeping their
        bytes: a run that goes on from an older step writes those step numbers again. Call
        it on one process, then :meth:`reload` on every process."""
        moved = []
        for s in steps:
            src = self.directory / str(s)
            if not src.is_dir():
                continue
            dest = self.directory / UNREADABLE_DIR / str(s)
            n = 1
            while dest.exists():
                dest = self.directory / UNREADABLE_DIR / f"{s}.{n}"
                n += 1
            dest.parent.mkdir(exist_ok=True)
            src.rename(dest)
            moved.append(dest)
        return moved

    def reload(self) -> None:
        """Read the list of steps from disk again (after :meth:`set_aside`)."""
        with _orbax_listing():
            self._manager.reload()

    # ------------------------------------------------------------------ restore

    def restore_intact(self, step: int | str | None, read: Callable[[int], T]) -> Restored[T]:
        """``read(s)`` for the step asked for: an int means exactly that step; 'latest' or
        None means the newest step that ``read`` gets through, skipping (and reporting)
        steps that raise :class:`CheckpointUnreadable`.

        ``read`` should restore through this object's methods, which verify what they read;
        any other exception it raises (a config mismatch, say) propagates: only damage
        makes it try an older step. Raises :class:`CheckpointNotFound`, and
        :class:`CheckpointUnreadable` for a damaged explicit step or
        :class:`NoIntactCheckpoint` when every step is damaged.
        """
        available = self.steps()
        explicit = step is not None and step != "latest"
        candidates = [self.resolve_step(step)] if explicit else available[::-1]
        if not candidates:
            raise CheckpointNotFound(f"no finalized checkpoint in {self.directory}")
        skipped: list[Skipped] = []
        for s in candidates:
            value: T | None = None
            failure: CheckpointUnreadable | None = None
            try:
                value = read(s)
            except CheckpointUnreadable as e:
                failure = e
            if _all_processes_agree(failure is None):
                return Restored(s, cast(T, value), tuple(skipped))
            reason = failure.reason if failure is not None else "unreadable on another process"
            if explicit:
                others = [a for a in available if a != s]
                hint = (
                    f"; restore another step ({', '.join(map(str, others))}) or the latest, "
                    "which skips damaged steps"
                    if others
                    else "; it is the only checkpoint"
                )
                raise CheckpointUnreadable(s, reason, hint) from failure
            skipped.append(Skipped(s, reason))
        raise NoIntactCheckpoint(self.directory, tuple(skipped))

    def restore(self, step: int | str | None, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore exactly ``step`` ('latest': the newest finalized) onto ``abstract_state``
        (a pytree of jax.ShapeDtypeStruct with shardings), verified against its checksums.

        ``abstract_state=None`` restores the arrays as saved (inspection, tests).
        """
        step = self.resolve_step(step)
        meta = self.restore_meta(step)
        self._check_target(step, meta, abstract_state)
        with self._reading(step, "state"):
            out = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        state = out["state"]
        self._verify(step, meta, state)
        return state, meta

    def restore_subset(self, step: int | str | None, abstract_subset: Any) -> Any:
        """Restore only the leaves ``abstract_subset`` names (a sub-pytree of the saved state,
        e.g. ``{"params": ...}`` of ``jax.ShapeDtypeStruct`` with shardings): nothing else
        (optimizer moments, say) is read from disk, and what is read is verified."""
        import jax

        step = self.resolve_step(step)
        meta = self.restore_meta(step)
        self._check_target(step, meta, abstract_subset)
        with self._reading(step, "state"):
            with _orbax_listing():
                reader = ocp.CheckpointManager(
                    self.directory,
                    item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                    options=ocp.CheckpointManagerOptions(read_only=True, create=False),
                )
            try:
                restore_args = jax.tree.map(
                    lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), abstract_subset
                )
                out = reader.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(
                            abstract_subset, restore_args=restore_args, partial_restore=True
                        )
                    ),
                )
            finally:
                reader.close()
        subset = out["state"]
        self._verify(step, meta, subset)
        return subset

    def restore_meta(self, step: int | str | None) -> dict[str, Any]:
        """The ``meta`` item of exactly ``step``, checked against its own sha256."""
        step = self.resolve_step(step)
        self._check_files(step)
        with self._reading(step, "meta"):
            out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(out["meta"])
        sums = meta.get("checksums")
        if sums is not None:
            if not isinstance(sums, dict) or sums.get("scheme") != checksum.SCHEME:
                raise CheckpointUnreadable(step, "meta: unknown checksum record")
            if sums.get("meta_sha256") != checksum.meta_digest(meta):
                raise CheckpointUnreadable(step, "meta: checksum mismatch")
        if meta.get("step", step) != step:
            raise CheckpointUnreadable(step, f"meta: written for step {meta['step']}")
        return meta

    # ------------------------------------------------------------------ checks

    def _check_files(self, step: int) -> None:
        """Orbax's commit record and item metadata exist and parse (a cheap first check that
        names the file, before Orbax's own errors would)."""
        root = self.directory / str(step)
        for name in _REQUIRED_FILES:
            path = root / name
            try:
                json.loads(path.read_text())
            except FileNotFoundError:
                raise CheckpointUnreadable(step, f"{name} is missing") from None
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise CheckpointUnreadable(
                    step, f"{name} is damaged ({_one_line(e, root)})"
                ) from None

    def _check_target(self, step: int, meta: dict[str, Any], target: Any) -> None:
        recorded = (meta.get("checksums") or {}).get("arrays")
        if target is None or not isinstance(recorded, dict):
            return
        why = checksum.structure_mismatch(recorded, checksum.structure_of(target))
        if why is not None:
            raise CheckpointMismatch(
                f"checkpoint step {step} in {self.directory} does not fit: {why}; the run's "
                "config (model or precision) differs from the one that saved it"
            )

    def _verify(self, step: int, meta: dict[str, Any], tree: Any) -> None:
        """Checksum what was read; checkpoints saved before checksums existed pass as read."""
        recorded = (meta.get("checksums") or {}).get("arrays")
        if not isinstance(recorded, dict):
            return
        read = checksum.array_checksums(tree)
        missing = [p for p in read if p not in recorded]
        if missing:
            raise CheckpointUnreadable(step, f"no checksum recorded for {missing[0]}")
        why = checksum.checksum_mismatch(recorded, read)
        if why is not None:
            raise CheckpointUnreadable(step, why)

    @contextmanager
    def _reading(self, step: int, item: str) -> Iterator[None]:
        """Any failure inside Orbax or TensorStore while reading ``step``: unreadable."""
        _report_read_leftovers_quietly()  # before: they can come before the failure is raised
        try:
            yield
        except (CheckpointUnreadable, CheckpointMismatch, MemoryError):
            raise
        except Exception as e:
            reason = _one_line(e, self.directory / str(step))
            raise CheckpointUnreadable(step, f"{item}: {reason}") from e

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for any save in flight, then release Orbax's threads; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.wait_until_finished()
        finally:
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
