"""The serve suite's in-process servers: one per distinct serving config.

A server is started on an ephemeral 127.0.0.1 port (uvicorn on a thread, the engine on its
own thread) over a randomly initialised model of the configured shape with the byte
tokenizer (throughput does not depend on the weights; ``ignore_eos`` fixes every output
length). Servers share an :class:`~jaxlab.infer.engine.Engine` (same seed, same weights)
wherever their KV pools are configured alike, so a second server of shapes already compiled
warms up without compiling; a server sizes its pool from its engine's config
(``Engine.pool_pages``), so a server with another pool gets an engine of its own.
:class:`Servers` keeps each server it started, keyed by its config: a case asking for a
server another case already started gets it back, warm. All of them stop when the pool
closes. Nothing here measures.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxlab.config import JaxlabConfig
    from jaxlab.serve import ModelService, ServedModel

#: Config fields a server starts with, by dotted path: ``{"serve.prefix_caching": False}``.
Sets = Mapping[str, Any]


def served_model(cfg: JaxlabConfig) -> ServedModel:
    """A randomly initialised model of ``cfg.model`` and the tokenizer to serve it with."""
    from jaxlab.infer.engine import Engine
    from jaxlab.serve import ServedModel
    from jaxlab.tokenizer import Tokenizer, byte_tokenizer

    tok = Tokenizer.load(cfg.tokenizer.path) if cfg.tokenizer.path else byte_tokenizer()
    return ServedModel(Engine.from_config(cfg, seed=0), tok)


def serve_cfg(
    cfg: JaxlabConfig, slots: int, new_tokens: int, sets: Sets | None = None
) -> JaxlabConfig:
    """``cfg`` for a benchmark server of ``slots`` slots: a queue and timeouts no load of
    the suite reaches, ``max_tokens`` up to ``new_tokens``, then ``sets`` (``{"serve.
    prefix_caching": False, ...}``), validated as a whole."""
    from jaxlab.config import JaxlabConfig

    data = cfg.model_dump()
    serve = data["serve"]
    serve["slots"] = slots
    serve["max_queue"] = max(serve["max_queue"], 512)
    serve["request_timeout_s"] = max(serve["request_timeout_s"], 600.0)
    serve["max_tokens_limit"] = max(serve["max_tokens_limit"], new_tokens)
    for path, value in (sets or {}).items():
        section, _, field = path.partition(".")
        if section not in ("serve", "inference") or field not in data[section]:
            raise KeyError(f"not a serve.* or inference.* field: {path}")
        data[section][field] = value
    return JaxlabConfig.model_validate(data)


def pool_pages(cfg: JaxlabConfig) -> int | None:
    """KV-cache pages of a server of ``cfg`` (every slot group together):
    ``inference.num_pages``, or by default enough for every slot to hold ``max_len``
    tokens. None for a ``kv_cache_mib`` budget (the server sizes that one)."""
    inf = cfg.inference
    if inf.num_pages is not None:
        return inf.num_pages
    if inf.kv_cache_mib is not None:
        return None
    max_len = inf.max_len or cfg.model.max_seq_len
    return cfg.serve.slots * math.ceil(max_len / inf.page_size)


@dataclass(frozen=True)
class Server:
    """A ready server: its base URL, its config, the service behind it and its ``info()``."""

    url: str
    cfg: JaxlabConfig
    service: ModelService
    info: dict[str, Any]

    @property
    def decode_groups(self) -> int:
        return int(self.info["decode_groups"])

    @property
    def num_pages(self) -> int | None:
        """The pool's pages as the server reports them, else as its config sizes them."""
        reported = self.info.get("kv_pages")
        return int(reported) if reported is not None else pool_pages(self.cfg)


#: The inference fields an engine sizes its KV pool from.
POOL_FIELDS = ("page_size", "num_pages", "kv_cache_mib")


def _pool_key(cfg: JaxlabConfig) -> tuple[Any, ...]:
    return tuple(getattr(cfg.inference, f) for f in POOL_FIELDS)


class Servers:
    """Started servers, one per resolved serving config (``serve.*`` and ``inference.*``);
    ``model`` serves ``cfg``'s own pool, and other pools get models of their own.
    ``warm(url, slots)`` runs once on each new server (untimed requests), ``status(text)``
    tells the live view."""

    def __init__(
        self,
        model: ServedModel,
        cfg: JaxlabConfig,
        new_tokens: int,
        *,
        warm: Callable[[str, int], object],
        status: Callable[[str], None],
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.new_tokens = new_tokens
        self._warm = warm
        self._status = status
        self._stack = contextlib.ExitStack()
        self._servers: dict[str, Server] = {}
        self._models: dict[tuple[Any, ...], ServedModel] = {_pool_key(cfg): model}

    def _model_for(self, cfg: JaxlabConfig) -> ServedModel:
        key = _pool_key(cfg)
        if key not in self._models:
            self._models[key] = served_model(cfg)
        return self._models[key]

    def get(self, slots: int, sets: Sets | None = None) -> Server:
        """The server of ``slots`` slots with ``sets`` applied: started (and warmed) now if
        no earlier call asked for the same."""
        cfg = serve_cfg(self.cfg, slots, self.new_tokens, sets)
        # Keyed by what the server runs with, so asking for a default explicitly is the same.
        key = json.dumps([cfg.serve.model_dump(), cfg.inference.model_dump()], default=str)
        if key in self._servers:
            return self._servers[key]
        what = ", ".join(f"{k}={v}" for k, v in (sets or {}).items())
        self._status(
            f"starting a {slots}-slot server{f' ({what})' if what else ''} "
            "(warm-up compiles every bucket)"
        )
        server = self._stack.enter_context(_started(self._model_for(cfg), cfg))
        self._warm(server.url, slots)
        self._servers[key] = server
        return server

    def close(self) -> None:
        self._stack.close()
        self._servers.clear()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _started(model: ServedModel, cfg: JaxlabConfig) -> Iterator[Server]:
    from jaxlab.serve import ModelService, ServerThread

    service = ModelService.from_engine(model.engine, model.tokenizer, cfg)
    srv = ServerThread(service).start()
    try:
        srv.wait_ready(timeout_s=1800)
        yield Server(srv.url, cfg, service, service.info())
    finally:
        srv.stop()


__all__ = ["POOL_FIELDS", "Server", "Servers", "Sets", "pool_pages", "serve_cfg", "served_model"]
