"""Checkpoints through Orbax: async saves, keep-last-K, atomic finalisation, resharding restore."""

from jaxlab.checkpoint.manager import Checkpointer, CheckpointNotFound

__all__ = ["CheckpointNotFound", "Checkpointer"]
