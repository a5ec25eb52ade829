"""Speculative decoding: a proposer drafts ``k`` tokens, the model verifies them in one pass.

=================  ===================================================================
``accept``         the acceptance rule (rejection sampling): exact for any proposer
``ngram``          prompt lookup: drafts from the row's own tokens, on the device
``draft``          a draft model: a jaxlab run of the same tokenizer, checked
``state``          :class:`SpecState`: the engine's state, token ids in pages, counters
``steps``          the jitted loop (propose, verify, accept, roll back), prefill, insert
``engine``         :class:`SpeculativeEngine`: the engine's verbs, speculating
=================  ===================================================================

See ``docs/speculative.md``.
"""

from jaxlab.infer.speculative.accept import accept
from jaxlab.infer.speculative.draft import DraftMismatch, draft_problem, load_draft
from jaxlab.infer.speculative.engine import SpeculativeEngine, is_speculative, with_speculation
from jaxlab.infer.speculative.ngram import lookup
from jaxlab.infer.speculative.state import SpecState, SpecStats
from jaxlab.infer.speculative.steps import SpecParams

__all__ = [
    "DraftMismatch",
    "SpecParams",
    "SpecState",
    "SpecStats",
    "SpeculativeEngine",
    "accept",
    "draft_problem",
    "is_speculative",
    "load_draft",
    "lookup",
    "with_speculation",
]
