"""A thin, honest wrapper over ``orbax.checkpoint.CheckpointManager``.

Each checkpoint step directory holds two items:

- ``state``: the array pytree (params, optimizer state, step, PRNG key), written by
  Orbax's standard handler, sharded as it lives on the devices, and restored onto
  whatever sharding the caller's abstract target asks for (so a checkpoint saved on one
  mesh restores on another).
- ``meta``: JSON with the resolved config (TOML text), the tokenizer files and their
  sha256, so a checkpoint is self-contained.

Atomicity is Orbax's: a step is written under a temporary name and renamed only when
every item is complete, and the manager lists finalized steps only, so a checkpoint
interrupted by SIGKILL mid-save is never picked up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointNotFound(Exception):
    """No (such) finalized checkpoint in a directory."""


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
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every_steps,
            max_to_keep=keep_last,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"), options=options
        )

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving ``state`` at ``step`` (async when enabled); True if a save started.

        Without ``force`` the manager's interval policy decides (every ``every_steps``).
        """
        if step in self._manager.all_steps():
            return False
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
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

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

    # ------------------------------------------------------------------ restore

    def restore(self, step: int | str | None, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore onto ``abstract_state`` (a pytree of jax.ShapeDtypeStruct with shardings).

        ``abstract_state=None`` restores the arrays as saved (inspection, tests).
        """
        step = self.resolve_step(step)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["meta"])

    def restore_subset(self, step: int | str | None, abstract_subset: Any) -> Any:
        """Restore only the leaves ``abstract_subset`` names (a sub-pytree of the saved state,
        e.g. ``{"params": ...}`` of ``jax.ShapeDtypeStruct`` with shardings): nothing else
        (optimizer moments, say) is read from disk."""
        import jax

        step = self.resolve_step(step)
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
        return out["state"]

    def restore_meta(self, step: int | str | None) -> dict[str, Any]:
        step = self.resolve_step(step)
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
