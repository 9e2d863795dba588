"""Running things: the gateway under uvicorn, a worker, and the two together for
the demo, each on one event loop (uvloop where it is installed)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

import uvicorn

from gateway.app import create_app
from gateway.config import Config, ModelConfig
from gateway.grpc_tls import ServerTLS
from gateway.state import GatewayState
from gateway.worker.engine import Engine
from gateway.worker.server import WorkerServer

log = logging.getLogger("furnace")


T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` on uvloop when available, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.run(main)
    return uvloop.run(main)


class GatewayServer(uvicorn.Server):
    """uvicorn's server with a drain in front of its shutdown: on SIGTERM or
    SIGINT, /ready turns false and new requests are refused while those in
    flight finish (up to `drain_timeout`); then uvicorn stops, and the process
    exits 0 (uvicorn would re-raise the signal, which reads as a crash).
    A second signal skips the rest of the drain."""

    def __init__(self, settings: uvicorn.Config, state: GatewayState) -> None:
        super().__init__(settings)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """Serves until drained and shut down."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Starts the drain; a second signal shuts down at once."""
        if self._drain is not None or self._loop is None:
            super().handle_exit(sig, frame)
        else:
            self._loop.call_soon_threadsafe(self._start_drain)
        self._captured_signals.clear()

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.state.drain(self.state.config.drain_timeout)
        self.should_exit = True


async def wait_for_stop_signal() -> None:
    """Returns on the first SIGTERM or SIGINT (main thread only)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def uvicorn_server(config: Config) -> uvicorn.Server:
    """A uvicorn server for the gateway app, with httptools and no access log
    (requests are logged by the gateway itself)."""
    app = create_app(config)
    settings = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http="httptools",
        lifespan="on",
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return GatewayServer(settings, app.state.gateway)


async def serve_gateway(config: Config) -> None:
    """The gateway until SIGINT or SIGTERM."""
    await uvicorn_server(config).serve()


async def serve_worker(engine: Engine, host: str, port: int, tls: ServerTLS | None = None) -> None:
    """A worker until SIGTERM or SIGINT; then calls in flight get a grace period."""
    worker = WorkerServer(engine, host, port, tls)
    await worker.start()
    try:
        await wait_for_stop_signal()
    finally:
        await worker.stop()


async def serve_demo(config: Config, engine: Engine) -> None:
    """The gateway with an embedded demo worker on a loopback port."""
    worker = WorkerServer(engine, "127.0.0.1", 0)
    await worker.start()
    model = ModelConfig(name=engine.model, workers=(worker.address,))
    try:
        await serve_gateway(Config(**{**config.__dict__, "models": (model,)}))
    finally:
        await worker.stop(grace=1.0)
