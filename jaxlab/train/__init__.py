"""Training: the pure step, optimizer, loop, run directory and evaluation."""

from jaxlab.train.run_dir import RunDir, new_run_id

__all__ = ["RunDir", "new_run_id"]
