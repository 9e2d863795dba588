"""A gRPC server for one engine: the Engine service and the standard health service.

It listens before the engine is up and says NOT_SERVING until it is, so an engine
that loads for minutes (vLLM) is visible, probed and not routed to meanwhile; an
engine that dies turns it NOT_SERVING for good (a watcher task, one per worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.protocol.grpc_options import SERVER_OPTIONS
from gateway.protocol.tls import ServerTLS, server_credentials
from gateway.protocol.v1 import engine_pb2
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker.engine import Engine
from gateway.worker.servicer import EngineService

log = logging.getLogger("furnace.worker")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
_SERVER_OPTIONS = (("grpc.so_reuseport", 0), *SERVER_OPTIONS)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _Health(health.aio.HealthServicer):
    """The standard health service, reporting one status for the whole worker ("" and
    the Engine service), whose Watch streams end once the worker stops (`end_watches`)
    after they told NOT_SERVING: a watch, which every gateway keeps open, would
    otherwise hold a stopping server to the end of its drain."""

    def __init__(self) -> None:
        super().__init__()
        self._serving = False
        self._changed = asyncio.Condition()
        self._ended = False

    async def set_all(self, serving: bool) -> None:
        """What Check and Watch report for both names."""
        for name in ("", SERVICE_NAME):
            await self.set(name, SERVING if serving else NOT_SERVING)
        async with self._changed:
            self._serving = serving
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """Ends every Watch stream once it has sent the current status."""
        async with self._changed:
            self._ended = True
            self._changed.notify_all()

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """The status, then each change of it; SERVICE_UNKNOWN for another name."""
        unknown = request.service not in ("", SERVICE_NAME)
        sent = None
        async with self._changed:
            while True:
                status = UNKNOWN if unknown else SERVING if self._serving else NOT_SERVING
                if status != sent:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    sent = status
                if self._ended:
                    return
                await self._changed.wait()


class WorkerServer:
    """Serves `engine` on `host:port`; port 0 picks a free one (`.port` and
    `.address` tell which once started)."""

    def __init__(
        self, engine: Engine, host: str = "127.0.0.1", port: int = 0, tls: ServerTLS | None = None
    ) -> None:
        self.engine = engine
        #: TLS (mutual with a client CA); None: plaintext.
        self.tls = tls
        self.service = EngineService(engine)
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._health = _Health()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        #: The engine died: the worker stays NOT_SERVING.
        self.engine_dead = False

    async def set_serving(self, serving: bool) -> None:
        """What the health service reports: SERVING or NOT_SERVING."""
        await self._health.set_all(serving)

    async def start(self) -> None:
        """Listens (on the running loop), serves, reports NOT_SERVING while the engine
        starts, then SERVING. An engine that fails to start stops the server."""
        server = self._server = grpc.aio.server(options=_SERVER_OPTIONS)
        pb_grpc.add_EngineServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        listen = f"{self.host}:{self.port}"
        if self.tls is None:
            self.port = server.add_insecure_port(listen)
        else:
            self.port = server.add_secure_port(listen, server_credentials(self.tls))
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}")
        self.address = f"{self.host}:{self.port}"
        await server.start()
        await self.set_serving(False)
        try:
            await self.engine.start()
        except BaseException:
            await server.stop(0)
            raise
        self._watch = asyncio.get_running_loop().create_task(self._watch_engine())
        await self.set_serving(True)
        log.info("worker for %s serving on %s", self.engine.model, self.address)

    async def _watch_engine(self) -> None:
        try:
            await self.engine.wait_dead()
        except Exception:
            log.exception("watching the engine of %s failed", self.engine.model)
        self.engine_dead = True
        log.error("the engine of %s died: reporting NOT_SERVING", self.engine.model)
        await self.set_serving(False)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Reports NOT_SERVING, refuses new calls, lets calls in flight finish for
        `grace` seconds (None: as long as they take), then cancels them, then shuts
        the engine down. Health watches end at once: the server stops as soon as the
        engine's calls have ended."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.set_serving(False)
        self.service.drain()
        await self._health.end_watches()
        if self._server is not None:
            await self._server.stop(grace)
        await self.engine.shutdown()
