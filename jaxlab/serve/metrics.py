"""Prometheus metrics of one server, on its own ``CollectorRegistry`` (never the global one).

Names follow vLLM's (prefix ``jaxlab_``). The per-request histograms and token counters
are observed by each request's output (:mod:`jaxlab.serve.output`, on the engine thread),
the gauges by the scheduler; ``jaxlab_requests_total{status}`` by the HTTP layer (one
increment per ``/v1/generate`` or ``/v1/completions`` request, labelled with the status
it answered); ``jaxlab_compilations_total{function}`` is read from the engine's compile
counters at scrape time. The ``jaxlab_model_*`` counters carry the ``model`` a request
named (the base model or a LoRA adapter, ``serve.adapters``): requests queued, prompt
tokens and generated tokens per model. This module defines and renders the metrics; it measures nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxlab.serve.lifecycle import ModelState

#: Latency buckets (seconds) wide enough for a CPU lab and an accelerator.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class _CompileCollector(Collector):
    """``jaxlab_compilations_total{function}`` from a callable returning the counts."""

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "jaxlab_compilations",
            "XLA executables built, per jitted engine function.",
            labels=["function"],
        )
        for name, n in sorted(self._counts().items()):
            fam.add_metric([name], float(n))
        yield fam

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "jaxlab_compilations", "XLA executables built.", labels=["function"]
        )


class ServeMetrics:
    """Every metric the server exports, registered on ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "jaxlab_time_to_first_token_seconds",
            "Arrival to first generated token (queue + prefill), per request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "jaxlab_time_per_output_token_seconds",
            "Mean time per output token after the first, per request (decode_s / (n - 1)).",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxlab_e2e_request_latency_seconds",
            "Arrival to last token, per finished request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "jaxlab_request_queue_time_seconds",
            "Arrival to admission into a decode slot, per admitted request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "jaxlab_num_requests_running",
            "Requests holding a decode slot (being prefilled or decoding).",
            registry=r,
        )
        self.waiting = Gauge(
            "jaxlab_num_requests_waiting", "Requests queued for a decode slot.", registry=r
        )
        self.kv_usage = Gauge(
            "jaxlab_kv_cache_usage_ratio",
            "KV-cache pages held by requests / pages, every slot group's pool together.",
            registry=r,
        )
        self.pages_used = Gauge(
            "jaxlab_kv_cache_pages_used",
            "KV-cache pages held by at least one request (cached pages nobody holds are free).",
            registry=r,
        )
        self.pages_total = Gauge(
            "jaxlab_kv_cache_pages_total",
            "KV-cache pages, every slot group's pool together (inference.num_pages).",
            registry=r,
        )
        self.preemptions = Counter(
            "jaxlab_num_preemptions",
            "Running requests preempted for lack of KV pages (recomputed when readmitted).",
            registry=r,
        )
        self.prefix_queries = Counter(
            "jaxlab_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, one lookup per admission.",
            registry=r,
        )
        self.prefix_hits = Counter(
            "jaxlab_prefix_cache_hits",
            "Prompt tokens whose K/V came from the prefix cache instead of a prefill.",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "jaxlab_spec_decode_draft_tokens",
            "Tokens drafted by speculative decoding's proposer (inference.speculative).",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "jaxlab_spec_decode_accepted_tokens",
            "Drafted tokens the model accepted (each saves a decode step).",
            registry=r,
        )
        self.slots = Gauge(
            "jaxlab_num_slots", "Decode slots (the batch of the KV cache).", registry=r
        )
        self.decode_groups = Gauge(
            "jaxlab_decode_groups",
            "Slot groups decoded concurrently, each its own batch and thread.",
            registry=r,
        )
        self.model_state = Gauge(
            "jaxlab_model_state",
            "1 for the current model lifecycle state, 0 for the others.",
            ["state"],
            registry=r,
        )
        self.prompt_tokens = Counter("jaxlab_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(
            "jaxlab_generation_tokens",
            "Tokens generated (stop tokens excluded), cancelled requests included.",
            registry=r,
        )
        self.requests = Counter(
            "jaxlab_requests",
            "Generation requests (/v1/generate, /v1/completions) by the HTTP status answered "
            "(499: the client went away mid-stream).",
            ["status"],
            registry=r,
        )
        self.model_requests = Counter(
            "jaxlab_model_requests",
            "Generation requests queued, by the model they named (the base or a LoRA adapter).",
            ["model"],
            registry=r,
        )
        self.model_prompt_tokens = Counter(
            "jaxlab_model_prompt_tokens",
            "Prompt tokens prefilled, by model (the base or a LoRA adapter).",
            ["model"],
            registry=r,
        )
        self.model_generation_tokens = Counter(
            "jaxlab_model_generation_tokens",
            "Tokens generated (stop tokens excluded), by model (the base or a LoRA adapter).",
            ["model"],
            registry=r,
        )
        self.set_state(ModelState.EMPTY)

    def declare_models(self, names: tuple[str, ...]) -> None:
        """Export the per-model counters at 0 for every served model from the start."""
        for name in names:
            self.model_requests.labels(model=name)
            self.model_prompt_tokens.labels(model=name)
            self.model_generation_tokens.labels(model=name)

    def set_state(self, state: ModelState) -> None:
        for s in ModelState:
            self.model_state.labels(state=s.value).set(1.0 if s == state else 0.0)

    def track_compiles(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export ``jaxlab_compilations_total{function}`` from ``counts()`` (once)."""
        self.registry.register(_CompileCollector(counts))

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["LATENCY_BUCKETS", "TOKEN_LATENCY_BUCKETS", "ServeMetrics"]
