"""jaxlab.serve: continuous-batching HTTP serving of a trained run (docs/serving.md).

Modules, bottom up:

=================  ===================================================================
``errors``         domain errors (queue full, not accepting, timeout, ...): no HTTP
``lifecycle``      the model's state machine (loading, warming, ready, draining, ...)
``metrics``        Prometheus metrics on the server's own registry
``policy``         pure scheduling decisions: slots, groups, chunks, page growth, fits
``slots``          slot groups: decode states, page pools and tables, their threads
``waiting``        the bounded, thread-safe waiting queue; cancellation and deadlines
``scheduler``      admission by memory, chunked prefill, preemption, the decode loop
``output``         one request's text, stop strings, timings, metrics and events
``service``        load, warm up, serve, drain, stop; the engine thread
``protocol``       request bodies and OpenAI-shaped error bodies
``app``            Starlette routes: HTTP only, the one error -> status mapping
``asgi``           the /v1 middleware (API key, request counter), body limit, SSE
``server``         uvicorn, signal-driven draining, a threaded server
``config``         the config ``jaxlab serve`` runs with
``loadgen``        the load generator of ``jaxlab bench serve``
=================  ===================================================================

Importing this package does not import jax; the engine thread does, when it loads.
"""

from jaxlab.serve.app import api_error, create_app
from jaxlab.serve.config import SERVE_SECTIONS, serve_config
from jaxlab.serve.errors import (
    Cancelled,
    EngineFailure,
    NotAccepting,
    QueueFull,
    RequestTimeout,
    ServeError,
    ShuttingDown,
)
from jaxlab.serve.lifecycle import IllegalTransition, Lifecycle, ModelState
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.output import Event, RequestStream
from jaxlab.serve.protocol import ApiError
from jaxlab.serve.scheduler import Output, Scheduler
from jaxlab.serve.server import ServeResult, ServerThread, run_server
from jaxlab.serve.service import ModelLoader, ModelService, ServedModel, run_dir_loader

__all__ = [
    "SERVE_SECTIONS",
    "ApiError",
    "Cancelled",
    "EngineFailure",
    "Event",
    "IllegalTransition",
    "Lifecycle",
    "ModelLoader",
    "ModelService",
    "ModelState",
    "NotAccepting",
    "Output",
    "QueueFull",
    "RequestStream",
    "RequestTimeout",
    "Scheduler",
    "ServeError",
    "ServeMetrics",
    "ServeResult",
    "ServedModel",
    "ServerThread",
    "ShuttingDown",
    "api_error",
    "create_app",
    "run_dir_loader",
    "run_server",
    "serve_config",
]
