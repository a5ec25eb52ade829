"""The end-to-end chain behind ``jaxlab reproduce`` (usable without the CLI)."""

from jaxlab.reproduce.chain import STAGES, Chain, ReproduceObserver, Reproduction, StageResult

__all__ = ["STAGES", "Chain", "ReproduceObserver", "Reproduction", "StageResult"]
