"""Running the app under uvicorn: signal-driven draining, the blocking and threaded forms.

SIGTERM (and SIGINT) do not stop uvicorn at once. The first one starts a drain: the model
goes ``ready -> draining`` (``/ready`` 503, new requests 503 + Retry-After) while the
listening socket stays open, in-flight requests (queued and running) finish within
``serve.drain_timeout_s``, and only then uvicorn shuts down (connections closed, lifespan
shutdown stops the engine thread, ``draining -> stopped``). A second signal during the drain
cuts it short: uvicorn stops waiting for connections, and requests still in flight fail. A
signal after the drain is over changes nothing: the shutdown is already under way.

It listens on TCP, or on a unix socket (``uds``: ``jaxlab serve --uds PATH``, the usual
set-up behind a reverse proxy on the same host, and the one transport a sandbox without
TCP leaves). Either way the socket is bound here, before the model loads, and handed to
uvicorn; a unix socket's file is removed again when the server exits.

It knows no requests and no model: the app (:mod:`jaxlab.serve.app`) and the service do.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from jaxlab.serve.app import create_app
from jaxlab.serve.lifecycle import ModelState
from jaxlab.serve.service import ModelService

log = logging.getLogger("jaxlab.serve")

#: On a forced exit, how long the requests just failed get to send their last events.
FORCED_EXIT_GRACE_S = 2.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (``port=0``: the OS picks a free one; read it back with
    ``sock.getsockname()[1]``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_for(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def bind_unix_socket(path: str | os.PathLike[str]) -> socket.socket:
    """A unix stream socket bound at ``path`` (its URL: :func:`unix_url`).

    A socket file that no server answers on (left by one that was killed) is replaced; a
    live server's socket, or a file that is not a socket, raises ``OSError`` naming it.
    """
    where = os.fspath(path)
    try:
        mode = os.lstat(where).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise OSError(errno.EEXIST, f"{where} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(where)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(where)  # stale: nobody listens there
        else:
            raise OSError(errno.EADDRINUSE, f"a server is already listening on {where}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(where)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def unix_url(path: str | os.PathLike[str]) -> str:
    """``unix:PATH``: how jaxlab names a server on a unix socket (``jaxlab bench serve
    --url``, :mod:`jaxlab.serve.loadgen`)."""
    return f"unix:{os.fspath(path)}"


def _remove_socket_file(path: str, inode: int) -> None:
    """Remove the socket file at ``path`` if it is still the one this server bound."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == inode:
            os.unlink(path)


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signals drain the model service first."""

    def __init__(self, config: uvicorn.Config, service: ModelService) -> None:
        super().__init__(config)
        self.service = service
        self.signal: int | None = None
        self.drained: bool | None = None
        self.forced = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: it would stop at once, and re-raise the signal at exit.
        if self.drained is not None:
            return  # the drain is over and uvicorn is shutting down: nothing to cut short
        if self.signal is not None or self._loop is None:
            # A second signal (or one before the loop runs): exit now.
            self.signal = self.signal or sig
            self.forced = self._drain_task is not None
            self.force_exit = self.forced
            self.should_exit = True
            return
        self.signal = sig
        self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        """Begin draining (on the server's loop); uvicorn exits when it is done."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the lifespan shutdown on a forced exit, so the app's lifespan
            # task would be cancelled at loop close (Starlette logs that as a traceback)
            # and the engine thread left running. Run it: the scheduler stops after its
            # current chunk and fails what is still in flight.
            await self.lifespan.shutdown()
            # The failed requests are now writing their error event and [DONE]; let them
            # finish (briefly) so the loop's close does not cancel them mid-send, which
            # uvicorn logs as an "Exception in ASGI application" traceback.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + FORCED_EXIT_GRACE_S
            while self.server_state.tasks and loop.time() < deadline:
                await asyncio.sleep(0.01)

    async def drain(self) -> None:
        try:
            finished = await self.service.drain()
            # After a forced exit the scheduler fails what was in flight, which also makes
            # it idle: that is not a drain that finished.
            self.drained = finished and not self.forced
        finally:
            self.should_exit = True

    def request_drain(self) -> None:
        """Thread-safe: start draining (the programmatic SIGTERM)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.start_drain)
        else:
            self.should_exit = True


def _uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=30,
    )


@dataclass
class ServeResult:
    """How a blocking :func:`run_server` ended."""

    signal: int | None
    drained: bool | None
    forced: bool
    state: ModelState
    error: str | None


def run_server(
    service: ModelService,
    *,
    host: str | None = None,
    port: int | None = None,
    uds: str | os.PathLike[str] | None = None,
    on_listening: Callable[[str, int], None] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> ServeResult:
    """Serve ``service`` in this (main) thread until SIGTERM/SIGINT or a failed load.

    ``uds``: listen on this unix socket instead of ``host:port`` (the URL is then
    ``unix:PATH`` and the port 0). ``on_listening(url, port)`` runs once the socket is
    bound (the model still loading), ``on_ready(url)`` when the model is ready.
    """
    host = service.serve_cfg.host if host is None else host
    port = service.serve_cfg.port if port is None else port
    if uds is not None:
        sock = bind_unix_socket(uds)
        bound, url = 0, unix_url(uds)
        cleanup = functools.partial(_remove_socket_file, os.fspath(uds), os.stat(uds).st_ino)
    else:
        sock = bind_socket(host, port)
        bound = sock.getsockname()[1]
        url = url_for(host, bound)
        cleanup = None
    server = DrainingServer(_uvicorn_config(create_app(service), host, bound), service)

    def on_change(old: ModelState, new: ModelState) -> None:
        if new == ModelState.READY and on_ready is not None:
            on_ready(url)
        if new == ModelState.FAILED:
            server.should_exit = True

    service.lifecycle.add_listener(on_change)
    try:
        if on_listening is not None:
            on_listening(url, bound)
        with contextlib.closing(sock):
            server.run(sockets=[sock])
    finally:
        if cleanup is not None:
            cleanup()
    return ServeResult(
        server.signal, server.drained, server.forced, service.state, service.lifecycle.error
    )


class ServerThread:
    """A real uvicorn server on a background thread (tests, benchmarks, notebooks).

    ::

        with ServerThread(service) as srv:       # binds 127.0.0.1, an ephemeral port
            srv.wait_ready()
            urllib.request.urlopen(srv.url + "/ready")
    """

    def __init__(
        self,
        service: ModelService,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        uds: str | os.PathLike[str] | None = None,
    ) -> None:
        self.service = service
        self.host = host
        self.uds = None if uds is None else os.fspath(uds)
        if self.uds is not None:  # a unix socket: url unix:PATH, port 0
            self._sock = bind_unix_socket(self.uds)
            self.port: int = 0
            self.url = unix_url(self.uds)
            self._inode: int | None = os.stat(self.uds).st_ino
        else:
            self._sock = bind_socket(host, port)
            self.port = self._sock.getsockname()[1]
            self.url = url_for(host, self.port)
            self._inode = None
        self.server = DrainingServer(_uvicorn_config(create_app(service), host, self.port), service)
        self._thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self._sock]},
            daemon=True,
            name=f"jaxlab-serve-{self.uds or self.port}",
        )

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self._thread.start()
        for _ in range(int(timeout_s / 0.01)):
            if self.server.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError(f"the server on {self.url} did not start")
        return self

    def wait_ready(self, timeout_s: float | None = 300.0) -> None:
        state = self.service.wait_ready(timeout_s)
        if state != ModelState.READY:
            raise RuntimeError(
                f"model not ready (state {state}): {self.service.lifecycle.error or 'timeout'}"
            )

    def drain(self, timeout_s: float = 60.0) -> None:
        """Drain (as SIGTERM does) and wait for the server to exit."""
        self.server.request_drain()
        self._thread.join(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Exit now (requests in flight fail); wait for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
        if self.uds is not None and self._inode is not None:
            _remove_socket_file(self.uds, self._inode)

    def wait_exit(self, timeout_s: float | None = None) -> bool:
        """Wait for the server thread to end; True if it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "DrainingServer",
    "ServeResult",
    "ServerThread",
    "bind_socket",
    "bind_unix_socket",
    "run_server",
    "unix_url",
    "url_for",
]
