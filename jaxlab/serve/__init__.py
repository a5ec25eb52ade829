"""jaxlab.serve: continuous-batching HTTP serving of a trained run (docs/serving.md).

Layers, bottom up: :mod:`~jaxlab.serve.lifecycle` (the model state machine),
:mod:`~jaxlab.serve.metrics` (Prometheus, own registry), :mod:`~jaxlab.serve.text`
(incremental detokenisation and stop strings), :mod:`~jaxlab.serve.scheduler` (slots,
queue and the decode loop on the engine thread), :mod:`~jaxlab.serve.service` (load, warm
up, drain), :mod:`~jaxlab.serve.app` (Starlette routes) and :mod:`~jaxlab.serve.server`
(uvicorn, signal-driven draining, a threaded server for tests and benchmarks).

Importing this package does not import jax; the engine thread does, when it loads.
"""

from jaxlab.serve.app import create_app
from jaxlab.serve.config import SERVE_SECTIONS, serve_config
from jaxlab.serve.lifecycle import IllegalTransition, Lifecycle, ModelState
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.protocol import ApiError
from jaxlab.serve.scheduler import (
    Event,
    GenRequest,
    NotAccepting,
    QueueFull,
    RequestHandle,
    Scheduler,
    ServeError,
)
from jaxlab.serve.server import ServeResult, ServerThread, run_server
from jaxlab.serve.service import ModelService, run_dir_loader
from jaxlab.tokenizer.detok import Detokenizer as TextAssembler

__all__ = [
    "SERVE_SECTIONS",
    "ApiError",
    "Event",
    "GenRequest",
    "IllegalTransition",
    "Lifecycle",
    "ModelService",
    "ModelState",
    "NotAccepting",
    "QueueFull",
    "RequestHandle",
    "Scheduler",
    "ServeError",
    "ServeMetrics",
    "ServeResult",
    "ServerThread",
    "TextAssembler",
    "create_app",
    "run_dir_loader",
    "run_server",
    "serve_config",
]
