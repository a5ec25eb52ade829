"""The model service: the lifecycle, and the engine thread that loads, warms and serves.

:class:`ModelService` is what the HTTP app talks to. ``start()`` spawns the engine
thread, which loads the model (``loading``: :func:`~jaxlab.infer.load.load_run` and an
:class:`~jaxlab.infer.engine.Engine`, or a :class:`ServedModel` built elsewhere), builds
the :class:`~jaxlab.serve.scheduler.Scheduler` and warms it (``warming``), turns ``ready``
and runs the scheduler loop until ``stop()``. ``drain()`` stops admission (``draining``)
and waits for the requests in flight.

Requests enter through :meth:`ModelService.request` (text -> a checked
:class:`~jaxlab.infer.request.Request`: the one place a request is checked) and
:meth:`ModelService.submit` (queued, with its :class:`~jaxlab.serve.output.RequestStream`).
The service raises domain errors (:mod:`jaxlab.serve.errors`, ``RequestError``); it knows
no HTTP status codes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxlab.serve.errors import NotAccepting
from jaxlab.serve.lifecycle import Lifecycle, ModelState
from jaxlab.serve.metrics import ServeMetrics
from jaxlab.serve.output import RequestStream
from jaxlab.serve.policy import decode_groups_for
from jaxlab.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from jaxlab.config import JaxlabConfig
    from jaxlab.infer.engine import Engine
    from jaxlab.infer.request import Limits, Request
    from jaxlab.infer.sampling import SamplingParams
    from jaxlab.infer.speculative import SpeculativeEngine
    from jaxlab.tokenizer import Tokenizer

log = logging.getLogger("jaxlab.serve")


@dataclass(frozen=True)
class ServedModel:
    """What a service serves: the engine (speculating when ``inference.speculative`` says
    so), the tokenizer of its text, and the checkpoint step it came from (None: not from a
    checkpoint)."""

    engine: Engine | SpeculativeEngine
    tokenizer: Tokenizer
    checkpoint_step: int | None = None


ModelLoader = Callable[[], ServedModel]

# Services in this process whose startup heap is frozen (see :func:`_freeze_startup_heap`).
_frozen_services = 0
_frozen_lock = threading.Lock()


def _freeze_startup_heap() -> None:
    """Collect once, then move every live object into the collector's permanent generation.

    A warmed server holds hundreds of thousands of GC-tracked objects (jax's tracing and
    compile caches, flax modules, the tokenizer), all alive for the life of the process.
    Every full (generation-2) collection walks them all with the GIL held, so the engine
    thread and the event loop both stop, and the stall lands in someone's TTFT
    (``docs/serving.md``). Frozen, a full collection walks only what was allocated since.
    Objects that die later by reference counting are still freed; only cyclic garbage
    among the frozen objects is kept.
    """
    global _frozen_services
    with _frozen_lock:
        gc.collect()
        gc.freeze()
        _frozen_services += 1


def _thaw_startup_heap() -> None:
    """Undo one :func:`_freeze_startup_heap`; the last service stopping unfreezes the heap
    (a process that starts and stops services, like tests or the bench, leaks nothing)."""
    global _frozen_services
    with _frozen_lock:
        _frozen_services -= 1
        if _frozen_services == 0:
            gc.unfreeze()


def run_dir_loader(
    run_dir: str | Path,
    step: int | None,
    cfg: JaxlabConfig,
    on_note: Callable[[str], None] | None = None,
) -> ModelLoader:
    """A loader restoring ``step`` (None = latest) of a run with ``cfg``'s inference section.

    ``on_note`` hears the one line that names damaged checkpoints skipped on the way
    (``LoadedRun.note``), if any. ``cfg.serve.adapters`` are loaded onto the engine, each
    checked against the checkpoint loaded (:mod:`jaxlab.serve.adapters`).
    """

    def load() -> ServedModel:
        from jaxlab.infer.engine import Engine
        from jaxlab.infer.load import load_run
        from jaxlab.infer.speculative import with_speculation

        run = load_run(run_dir, step, cfg=cfg)
        if run.note is not None and on_note is not None:
            on_note(run.note)
        stacked = None
        if cfg.serve.adapters:
            from jaxlab.serve.adapters import base_params_sha256, load_adapters

            _, digest = base_params_sha256(run_dir, run.step)
            _, stacked = load_adapters(cfg.serve.adapters, digest, run.cfg.model)
        engine = Engine(run.graphdef, run.params, run.cfg, adapters=stacked)
        spec = with_speculation(engine, run.cfg.inference.speculative, run.tokenizer)
        return ServedModel(spec, run.tokenizer, run.step)

    return load


class ModelService:
    """Owns one model and serves requests to it (see the module docstring).

    Args:
      cfg: the resolved config (``serve`` and ``inference`` sections are used).
      load: builds the :class:`ServedModel` (on the engine thread).
      metrics: a fresh :class:`ServeMetrics` (own registry) by default.
    """

    def __init__(
        self, cfg: JaxlabConfig, load: ModelLoader, *, metrics: ServeMetrics | None = None
    ) -> None:
        self.cfg = cfg
        self.serve_cfg = cfg.serve
        self._load = load
        self.metrics = metrics or ServeMetrics()
        self.lifecycle = Lifecycle()
        self.lifecycle.add_listener(lambda old, new: self.metrics.set_state(new))
        self.lifecycle.add_listener(self._log_change)
        self.metrics.declare_models(self.model_names)
        self.model: ServedModel | None = None
        self.scheduler: Scheduler | None = None
        self._limits: Limits | None = None
        self.load_s: float | None = None
        self.chunk_delay_s = 0.0
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._compiles_tracked = False
        self._heap_frozen = False

    @classmethod
    def from_run_dir(
        cls,
        cfg: JaxlabConfig,
        run_dir: str | Path,
        step: int | None = None,
        *,
        on_note: Callable[[str], None] | None = None,
    ) -> ModelService:
        return cls(cfg, run_dir_loader(run_dir, step, cfg, on_note))

    @classmethod
    def from_engine(
        cls,
        engine: Engine | SpeculativeEngine,
        tokenizer: Tokenizer,
        cfg: JaxlabConfig | None = None,
        *,
        checkpoint_step: int | None = None,
    ) -> ModelService:
        """Serve an already built engine (its compiled executables are reused); with
        ``inference.speculative`` set in ``cfg``, speculating (the draft model, if any, is
        loaded with the model)."""
        cfg = cfg or engine.cfg
        spec = cfg.inference.speculative

        def load() -> ServedModel:
            from jaxlab.infer.speculative import is_speculative, with_speculation

            served = engine
            if spec.method != "off" and not is_speculative(engine):
                served = with_speculation(engine, spec, tokenizer)  # type: ignore[arg-type]
            return ServedModel(served, tokenizer, checkpoint_step)

        return cls(cfg, load)

    # ------------------------------------------------------------------ facts

    @property
    def state(self) -> ModelState:
        return self.lifecycle.state

    @property
    def model_name(self) -> str:
        return self.serve_cfg.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every ``model`` a request may name: the base, then each LoRA adapter
        (``serve.adapters``); a name's index is its adapter id."""
        return (self.model_name, *self.serve_cfg.adapters)

    def adapter_id(self, name: str) -> int | None:
        """The adapter id of model ``name`` (0: the base model), or None if not served."""
        names = self.model_names
        return names.index(name) if name in names else None

    @property
    def engine(self) -> Engine | SpeculativeEngine | None:
        return self.model.engine if self.model is not None else None

    def info(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "model": self.model_name,
            "adapters": list(self.serve_cfg.adapters),
            "state": str(self.state),
            "checkpoint_step": self.model.checkpoint_step if self.model is not None else None,
            "platform": eng.platform if eng is not None else None,
            "precision": eng.precision if eng is not None else None,
            "slots": self.serve_cfg.slots,
            "decode_groups": len(self.scheduler.groups) if self.scheduler is not None else None,
            "max_len": eng.max_len if eng is not None else None,
            "prefill_buckets": list(eng.buckets) if eng is not None else None,
            "chunk_tokens": self.scheduler.chunk_tokens if self.scheduler is not None else None,
            "page_size": eng.page_size if eng is not None else None,
            "kv_pages": self.scheduler.num_pages if self.scheduler is not None else None,
            "prefix_caching": self.serve_cfg.prefix_caching,
            "speculative": self._speculative(),
            "prefill_chunk_tokens": self.serve_cfg.prefill_chunk_tokens,
        }

    def _speculative(self) -> dict[str, Any] | None:
        spec = self.cfg.inference.speculative
        if spec.method == "off":
            return None
        return {"method": spec.method, "k": spec.k, "draft_run_dir": spec.draft_run_dir}

    def _log_change(self, old: ModelState, new: ModelState) -> None:
        log.info("model state %s -> %s", old, new)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn the engine thread (load, warm up, serve). Returns at once."""
        if self._thread is not None:
            raise RuntimeError("the service was already started")
        self._thread = threading.Thread(target=self._main, name="jaxlab-engine", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self._load_warm_serve()
        finally:  # only this thread freezes and thaws, so the flag needs no lock
            if self._heap_frozen:
                self._heap_frozen = False
                _thaw_startup_heap()

    def _load_warm_serve(self) -> None:
        lc = self.lifecycle
        try:
            lc.to(ModelState.LOADING)
            t0 = time.perf_counter()
            model = self._load()
            self.load_s = time.perf_counter() - t0
            engine = model.engine
            held = getattr(engine, "num_adapters", 0)
            if held != len(self.serve_cfg.adapters):
                raise ValueError(
                    f"serve.adapters names {len(self.serve_cfg.adapters)} adapter(s) but the "
                    f"engine holds {held}"
                )
            self._limits = engine.limits(model.tokenizer.eot_id)
            self.model = model
            if self._stop_requested:
                lc.to(ModelState.STOPPED)
                return
            lc.to(ModelState.WARMING)
            groups = decode_groups_for(
                self.serve_cfg.slots, self.serve_cfg.decode_groups, engine.platform
            )
            sched = Scheduler(
                engine,
                slots=self.serve_cfg.slots,
                decode_groups=groups,
                prefill_batch=self.serve_cfg.prefill_batch,
                max_queue=self.serve_cfg.max_queue,
                request_timeout_s=self.serve_cfg.request_timeout_s,
                chunk_tokens=self.cfg.inference.stream_chunk_tokens,
                num_pages=engine.pool_pages(self.serve_cfg.slots),  # the groups split it
                prefill_chunk_tokens=self.serve_cfg.prefill_chunk_tokens,
                prefix_caching=self.serve_cfg.prefix_caching,
                metrics=self.metrics,
            )
            sched.chunk_delay_s = self.chunk_delay_s
            if not self._compiles_tracked:
                self.metrics.track_compiles(lambda: engine.compiles)
                self._compiles_tracked = True
            # A stop (SIGTERM) during warm-up ends it before the next compile.
            warmed = sched.warmup(should_stop=lambda: self._stop_requested)
            if warmed is not None:
                self.scheduler = sched
            else:  # cut short: never usable, so its group threads end here
                sched.groups.close()
            if self._stop_requested:
                lc.to(ModelState.STOPPED)
                return
            _freeze_startup_heap()
            self._heap_frozen = True
            lc.to(ModelState.READY)
        except Exception as e:
            log.error("model failed to load: %s", e)
            log.debug("%s", traceback.format_exc())
            if lc.can(ModelState.FAILED):
                lc.to(ModelState.FAILED, error=f"{type(e).__name__}: {e}")
            return
        try:
            sched.run()
        except Exception as e:  # the loop itself crashed: nothing can be served any more
            log.exception("the scheduler loop crashed")
            if lc.can(ModelState.FAILED):
                lc.to(ModelState.FAILED, error=f"scheduler crashed: {type(e).__name__}: {e}")

    def wait_ready(self, timeout: float | None = None) -> ModelState:
        """Block until ready (or a terminal state, or the timeout); return the state."""
        return self.lifecycle.wait_for({ModelState.READY}, timeout)

    def begin_drain(self) -> bool:
        """Stop admitting. True if the model was serving (then it is ``draining``)."""
        self._stop_requested = True
        if self.lifecycle.can(ModelState.DRAINING) and self.state == ModelState.READY:
            self.lifecycle.to(ModelState.DRAINING)
            if self.scheduler is not None:
                self.scheduler.close_admission()
            return True
        return False

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Stop admitting and wait for queued and running requests (at most ``timeout_s``,
        default ``serve.drain_timeout_s``). True if everything in flight finished."""
        timeout_s = self.serve_cfg.drain_timeout_s if timeout_s is None else timeout_s
        self.begin_drain()
        sched = self.scheduler
        if sched is None:
            return True
        deadline = time.perf_counter() + timeout_s
        while not sched.idle:
            if time.perf_counter() >= deadline:
                log.warning(
                    "drain timeout (%.1fs): %d running, %d waiting requests are cut off",
                    timeout_s,
                    sched.num_running,
                    sched.num_waiting,
                )
                return False
            await asyncio.sleep(0.02)
        return True

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the engine thread; requests still in flight fail (``ShuttingDown``)."""
        self._stop_requested = True
        if self.scheduler is not None:
            self.scheduler.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        lc = self.lifecycle
        if lc.state == ModelState.READY:
            lc.to(ModelState.DRAINING)
        if lc.can(ModelState.STOPPED):
            lc.to(ModelState.STOPPED)

    # ------------------------------------------------------------------ requests

    def request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        stop: Sequence[str] = (),
        *,
        adapter: int = 0,
    ) -> Request:
        """``prompt`` (text, or token ids such as a rendered chat) encoded and checked against the model (``Request.create``, the one
        check a request gets) and the KV pool (a request that could never fit it is refused
        here, never queued). Raises :class:`NotAccepting` unless ``ready``, and
        ``BadRequest``/``RequestTooLong``."""
        from jaxlab.infer.request import Request, RequestTooLong

        model, limits, sched = self.model, self._limits, self.scheduler
        if self.state != ModelState.READY or model is None or limits is None or sched is None:
            raise NotAccepting(str(self.state))
        ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not 0 <= adapter < len(self.model_names):
            raise ValueError(f"adapter id {adapter} out of range 0..{len(self.model_names) - 1}")
        req = Request.create(ids, sampling, limits, stop=stop, adapter=adapter)
        problem = sched.refusal(req)
        if problem is not None:
            raise RequestTooLong(problem, param="prompt")
        return req

    def submit(
        self,
        request: Request,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        stream: bool = False,
    ) -> RequestStream:
        """Queue ``request``; its output arrives on the returned stream (events on ``loop``'s
        thread, or a blocking queue without one). Raises :class:`NotAccepting` unless
        ``ready``, and ``QueueFull``."""
        sched, model = self.scheduler, self.model
        if self.state != ModelState.READY or sched is None or model is None:
            raise NotAccepting(str(self.state))
        out = RequestStream(
            request,
            model.tokenizer,
            metrics=self.metrics,
            loop=loop,
            stream=stream,
            model=self.model_names[request.adapter],
        )
        rid = sched.submit(request, out)
        self.metrics.model_requests.labels(model=out.model).inc()
        out.on_cancel(lambda: sched.cancel(rid))
        return out


__all__ = ["ModelLoader", "ModelService", "ServedModel", "run_dir_loader"]
