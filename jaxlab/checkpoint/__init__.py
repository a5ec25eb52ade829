"""Checkpoints through Orbax: async saves, keep-last-K, atomic finalisation, resharding restore,
checksums verified on every restore, and a fallback to the newest intact step."""

from jaxlab.checkpoint.manager import (
    Checkpointer,
    CheckpointMismatch,
    CheckpointNotFound,
    CheckpointUnreadable,
    NoIntactCheckpoint,
    Restored,
    Skipped,
)

__all__ = [
    "CheckpointMismatch",
    "CheckpointNotFound",
    "CheckpointUnreadable",
    "Checkpointer",
    "NoIntactCheckpoint",
    "Restored",
    "Skipped",
]
