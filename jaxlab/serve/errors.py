"""Why a request was refused or ended without finishing: the serving stack's domain errors.

The service and the scheduler raise these (or report them to a request's output); they say
what happened, never how a protocol answers it. :mod:`jaxlab.serve.app` is the one place
that maps them to HTTP statuses, codes and ``Retry-After`` headers. A request that can
never run (malformed, too long for the cache) is a
:class:`~jaxlab.infer.request.RequestError` instead, raised by ``Request.create``.

Import-light: no jax.
"""

from __future__ import annotations


class ServeError(Exception):
    """A request the server could not serve; ``message`` is for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(ServeError):
    """``serve.max_queue`` requests are already waiting for a slot."""

    def __init__(self, waiting: int) -> None:
        super().__init__(
            f"the request queue is full ({waiting} waiting = serve.max_queue); retry later"
        )


class NotAccepting(ServeError):
    """The model is not taking requests: not ready yet, draining, stopped or failed."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the model is not accepting requests (state: {state})")
        self.state = state


class RequestTimeout(ServeError):
    """Arrival to last token took longer than ``serve.request_timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"request exceeded serve.request_timeout_s = {timeout_s:g}s")
        self.timeout_s = timeout_s


class Cancelled(ServeError):
    """The caller cancelled the request (a client that went away)."""

    def __init__(self) -> None:
        super().__init__("cancelled")


class ShuttingDown(ServeError):
    """The scheduler stopped while the request was queued or running."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message)


class EngineFailure(ServeError):
    """A device call (prefill, insert, generate) or output processing raised."""


__all__ = [
    "Cancelled",
    "EngineFailure",
    "NotAccepting",
    "QueueFull",
    "RequestTimeout",
    "ServeError",
    "ShuttingDown",
]
