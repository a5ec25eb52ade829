"""One generation request, the type that flows through the whole stack, checked once.

A :class:`Request` is what the CLI, offline generation and the server all build: prompt
token ids, sampling parameters (with the request's full stop-token set, EOS included) and
optional stop strings. :meth:`Request.create` is the one place a request is validated
against the model and cache (:class:`Limits`); everything downstream trusts it.

Text never enters here: callers encode with their tokenizer first, and stop strings are
matched after detokenisation (``jaxlab.serve.output``), outside the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from jaxlab.infer.sampling import SamplingParams


class RequestError(ValueError):
    """A request that can never run; ``param`` names the request field at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequest(RequestError):
    """Malformed: an empty prompt, a token id outside the vocabulary, bad sampling values."""


class RequestTooLong(RequestError):
    """The prompt plus ``max_new_tokens`` does not fit the cache (``inference.max_len``)."""


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's vocabulary, the cache's capacity, and
    the tokenizer's end-of-text id (None: no EOS stops generation)."""

    vocab_size: int
    max_len: int
    eos_id: int | None = None


@dataclass(frozen=True)
class Request:
    """A checked request (build it with :meth:`create`). ``adapter``: the LoRA adapter id
    it runs with (0: the base model; the server maps ``model`` names to ids)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    adapter: int = 0

    @classmethod
    def create(
        cls,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        limits: Limits,
        *,
        stop: Sequence[str] = (),
        adapter: int = 0,
    ) -> Request:
        """Check the request and fold ``limits.eos_id`` into its stop tokens.

        Raises :class:`BadRequest` or :class:`RequestTooLong` naming the field, the value
        and the fix.
        """
        ids = tuple(int(t) for t in prompt_ids)
        bad = sampling.problem()
        if bad is not None:
            raise BadRequest(bad[1], param=bad[0])
        if not ids:
            raise BadRequest(
                "the prompt is empty (0 tokens); give at least one token", param="prompt"
            )
        vocab = limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"prompt token id {bad[0]} out of range for vocab_size={vocab}", param="prompt"
            )
        stops = [t for t in sampling.stop_token_ids if not 0 <= t < vocab]
        if stops:
            raise BadRequest(
                f"stop token id {stops[0]} out of range for vocab_size={vocab}",
                param="stop_token_ids",
            )
        need = len(ids) + sampling.max_new_tokens
        if need > limits.max_len:
            raise RequestTooLong(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                f"{need} exceeds inference.max_len = {limits.max_len}; shorten the prompt, "
                f"lower max_new_tokens or raise inference.max_len",
                param="prompt",
            )
        stops_text = tuple(s for s in stop if s)
        return cls(ids, sampling.with_eos(limits.eos_id), stops_text, adapter)

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end the request (EOS included unless ignored); never returned."""
        return frozenset(self.sampling.stop_token_ids)


__all__ = ["BadRequest", "Limits", "Request", "RequestError", "RequestTooLong"]
