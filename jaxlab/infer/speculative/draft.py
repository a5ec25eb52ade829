"""The draft model of speculative decoding: any jaxlab run that shares the target's tokenizer.

A draft proposes token ids, and the target judges them as its own ids: the two must mean
the same text by the same id. The tokenizer's content hash (``Tokenizer.sha256``: its
ranks, special tokens and split pattern) is what identity means here; the vocabulary
sizes of both models must be equal too (the acceptance rule compares distributions over
the same ids), and the draft must reach the target's ``inference.max_len`` positions.
Every refusal is a :class:`DraftMismatch` naming the draft run, what differs and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxlab.config import JaxlabConfig
    from jaxlab.infer.engine import Engine
    from jaxlab.tokenizer import Tokenizer


class DraftMismatch(ValueError):
    """The draft run cannot draft for this target (the message says why and the fix)."""


def draft_problem(
    where: str,
    target_cfg: JaxlabConfig,
    target_tokenizer: Tokenizer,
    draft_cfg: JaxlabConfig,
    draft_tokenizer: Tokenizer,
) -> str | None:
    """Why the draft run at ``where`` cannot draft for the target, or None."""
    if draft_tokenizer.sha256 != target_tokenizer.sha256:
        return (
            f"draft run {where}: its tokenizer ({draft_tokenizer.name}, sha256"
            f" {draft_tokenizer.sha256[:12]}...) is not the target's ({target_tokenizer.name},"
            f" sha256 {target_tokenizer.sha256[:12]}...); a draft model must share the target's"
            " tokenizer: train it with tokenizer.path set to the target run's tokenizer/"
        )
    dv, tv = draft_cfg.model.vocab_size, target_cfg.model.vocab_size
    if dv != tv:
        return (
            f"draft run {where}: model.vocab_size = {dv}, the target's is {tv}; the"
            " acceptance rule compares distributions over the same ids: train the draft with"
            f" model.vocab_size = {tv}"
        )
    need = target_cfg.inference.max_len or target_cfg.model.max_seq_len
    if draft_cfg.model.max_seq_len < need:
        return (
            f"draft run {where}: model.max_seq_len = {draft_cfg.model.max_seq_len} is shorter"
            f" than the target's inference.max_len = {need}; train the draft with"
            f" model.max_seq_len >= {need}, or lower inference.max_len"
        )
    return None


def _tokenizer_sha(run_dir: Path) -> str | None:
    import json

    meta = run_dir / "tokenizer" / "tokenizer.json"
    try:
        return str(json.loads(meta.read_text())["sha256"])
    except (OSError, ValueError, KeyError):
        return None


def draft_dir_problem(target_run_dir: str | Path, draft_run_dir: str | Path) -> str | None:
    """The checks a command can make before loading any weights (files only; importing this
    package does import jax): the draft is a run directory with checkpoints, and its saved
    tokenizer hashes like the target's (when both runs saved theirs beside the
    checkpoints). None when nothing is wrong so far."""
    draft = Path(draft_run_dir)
    if not (draft / "checkpoints").is_dir():
        return (
            f"inference.speculative.draft_run_dir = {str(draft_run_dir)!r} is not a run"
            " directory with checkpoints (jaxlab train)"
        )
    mine, theirs = _tokenizer_sha(Path(target_run_dir)), _tokenizer_sha(draft)
    if mine is not None and theirs is not None and mine != theirs:
        return (
            f"draft run {draft_run_dir}: its tokenizer (sha256 {theirs[:12]}...) is not the"
            f" target's (sha256 {mine[:12]}...); a draft model must share the target's"
            " tokenizer: train it with tokenizer.path set to the target run's tokenizer/"
        )
    return None


def load_draft(
    run_dir: str | Path, target: Engine, target_tokenizer: Tokenizer, step: int | None = None
) -> Engine:
    """The draft run at ``run_dir`` (its latest intact checkpoint, or ``step``) as an
    :class:`~jaxlab.infer.engine.Engine` with the target's ``inference`` section (cache
    length, page size), ready for :class:`~jaxlab.infer.speculative.SpeculativeEngine`.
    Raises :class:`DraftMismatch`, and what :func:`~jaxlab.infer.load.load_run` raises for
    a directory that is not a run."""
    from jaxlab.config import JaxlabConfig
    from jaxlab.infer.engine import Engine
    from jaxlab.infer.load import load_run

    run = load_run(run_dir, step)
    problem = draft_problem(str(run_dir), target.cfg, target_tokenizer, run.cfg, run.tokenizer)
    if problem is not None:
        raise DraftMismatch(problem)
    data = run.cfg.model_dump()
    data["inference"] = {**target.cfg.inference.model_dump(), "max_len": target.max_len}
    return Engine(run.graphdef, run.params, JaxlabConfig.model_validate(data))


__all__ = ["DraftMismatch", "draft_dir_problem", "draft_problem", "load_draft"]
