"""Start and stop, each as one ordered sequence: the gateway under uvicorn, a
worker, and the two together for the demo, each on one event loop (uvloop
where it is installed).

The gateway's sequence (`GatewayServer`):

    start   build the parts on the serving loop (channels belong to the loop that
            uses them) → start the fleet (resolve workers, watch their health)
            → start the teams (keys file, Redis) → bind (the public listener, then
            the admin one where `admin_port` is set) → ready
    stop    unready (/ready says 503, load balancers stop sending) → drain (new
            requests get 503, those in flight get `drain_timeout`, the rest are
            cancelled; their workers see it) → stop uvicorn (close the listener
            and the connections; then the admin listener's) → close the teams
            (the keys file's watch, Redis) → close the fleet (channels, HTTP
            clients) → exit 0

A start that fails closes what it had opened, in the stop's order (`_close`). The
signals (SIGTERM, SIGINT) are ours, not uvicorn's: the first starts the stop,
a second cuts the drain short.

Several such processes on one port (`serve --workers N`) are `processes.py`'s:
each one is this sequence, its listener bound with SO_REUSEPORT.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from email.utils import formatdate
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from uvicorn.lifespan.off import LifespanOff

from gateway.admission import Admission, InFlight, Slots
from gateway.admission.metrics import AdmissionCollector
from gateway.config import Config, ModelConfig
from gateway.edge.app import admin_on_public, create_admin_app, create_app
from gateway.edge.asgi import ASGIApp
from gateway.edge.batches.runner import BatchRunner, BatchSettings
from gateway.edge.batches.store import open_batches
from gateway.edge.http_protocol import HttpLimits, protocol_for
from gateway.edge.middleware import ExactRoutes
from gateway.fleet import Fleet
from gateway.fleet.metrics import FleetCollector
from gateway.teams import Teams
from gateway.telemetry import Telemetry
from gateway.telemetry.tracing import Tracing
from gateway.worker.engine import Engine
from gateway.worker.server import WorkerServer
from gateway.worker.tensor.demo import DEMO_TENSOR_MODEL, DemoTensorEngine
from gateway.worker.tensor.server import start_tensor_server

log = logging.getLogger("furnace")

T = TypeVar("T")

#: Seconds uvicorn gives open connections to finish once the drain is over.
CLOSE_GRACE = 5
#: Seconds an idle keep-alive connection stays open (uvicorn closes it).
KEEP_ALIVE = 5


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` on uvloop when available, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.run(main)
    return uvloop.run(main)


class Gateway:
    """The parts of one gateway, each given what it needs and nothing more; with
    `config_file` (the file `config` was read from), the teams read it again when it
    changes (budgets, prices, aliases, fallbacks: `gateway.teams.reload`)."""

    def __init__(
        self,
        config: Config,
        config_file: str | None = None,
        share: Callable[[Config], Config] | None = None,
    ) -> None:
        self.config = config
        self.ready = False
        self.slots = Slots(config.max_concurrent_requests)
        self.inflight = InFlight(self.slots)
        self.telemetry = Telemetry(config.log_prompts)
        self.tracing = Tracing(config.tracing)
        self.fleet = Fleet(config)
        registry = self.telemetry.registry
        self.teams = Teams(config, registry, config_file, share)
        self.admission = Admission(
            config, self.inflight, self.fleet, self.teams, self.telemetry, registry
        )
        registry.register(AdmissionCollector(self.inflight))
        registry.register(FleetCollector(self.fleet))

        def is_ready() -> bool:
            return self.ready and not self.inflight.draining

        #: The Batch API's runs (/v1/batches), on the teams' Redis when they have one.
        self.batches = BatchRunner(
            open_batches(self.teams.limiter.redis, config.batch_ttl, config.batch_files_per_team),
            self.teams,
            self.inflight,
            BatchSettings(
                config.batch_concurrency,
                config.batch_priority,
                config.batch_max_requests,
                config.max_body_bytes,
            ),
            self.telemetry.metrics,
        )
        self.app: ExactRoutes = create_app(
            config,
            batches=self.batches,
            fleet=self.fleet,
            inflight=self.inflight,
            teams=self.teams,
            admission=self.admission,
            telemetry=self.telemetry,
            tracing=self.tracing,
            is_ready=is_ready,
            started_at=int(time.time()),
        )
        #: The admin listener's app (`admin_port`), or None.
        self.admin_app: Starlette | None = None
        if config.admin_port is not None:
            self.admin_app = create_admin_app(
                config,
                fleet=self.fleet,
                inflight=self.inflight,
                telemetry=self.telemetry,
                is_ready=is_ready,
                teams=self.teams,
            )


def uvicorn_config(
    config: Config, app: ASGIApp | Starlette, host: str, port: int
) -> uvicorn.Config:
    """uvicorn's settings for one of the gateway's listeners: our HTTP protocol with
    the config's bounds, no lifespan, no access log of uvicorn's, its lines in the
    process's log format."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_for(
            HttpLimits(
                max_header_bytes=config.max_header_bytes,
                max_headers=config.max_headers,
                header_timeout=config.header_timeout,
                body_timeout=config.body_timeout,
                max_connections=config.max_connections,
                retry_after=config.retry_after,
            )
        ),
        timeout_keep_alive=KEEP_ALIVE,
        lifespan="off",  # the parts are started and closed here, in order
        log_level=config.log_level,
        access_log=False,  # the gateway logs each request itself
        log_config=None,  # uvicorn's lines go through the process's logging, in its format
        # No X-Forwarded-* rewriting of the client and scheme: nothing reads
        # them, and it costs a middleware and an address parse per request.
        proxy_headers=False,
        timeout_graceful_shutdown=CLOSE_GRACE,
        server_header=False,  # nothing to advertise; the Date header is `keep_dates`'
    )


class GatewayServer:
    """One gateway process: `start`, then `stop` (or `serve` for both around
    the signals). Create it on the loop that will serve. With `reuse_port` its
    public listener shares the port with the other processes of the gateway."""

    def __init__(
        self,
        config: Config,
        reuse_port: bool = False,
        config_file: str | None = None,
        share: Callable[[Config], Config] | None = None,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.gateway = Gateway(config, config_file, share)
        self.uvicorn = self._server(self.gateway.app, config.host, config.port)
        #: The admin listener (`admin_port`), with the same protocol and limits.
        self.admin: uvicorn.Server | None = None
        if self.gateway.admin_app is not None and config.admin_port is not None:
            host = config.admin_host or config.host
            self.admin = self._server(self.gateway.admin_app, host, config.admin_port)
        self._opened: list[str] = []
        self._dates: asyncio.Task[None] | None = None

    def _server(self, app: ASGIApp | Starlette, host: str, port: int) -> uvicorn.Server:
        return uvicorn.Server(uvicorn_config(self.config, app, host, port))

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, when the config says 0)."""
        return int(self.uvicorn.servers[0].sockets[0].getsockname()[1])

    @property
    def admin_port(self) -> int | None:
        """The admin listener's port (the one picked, when the config says 0),
        or None without `admin_port`."""
        if self.admin is None:
            return None
        return int(self.admin.servers[0].sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Opens everything, in order, and turns ready; a failure closes what
        was opened and raises."""
        gateway = self.gateway
        try:
            # 1. The fleet: resolve workers and wait briefly for their first health report.
            self._opened.append("fleet")
            await gateway.fleet.start()
            # 2. The teams: the keys file's reloads, and Redis.
            self._opened.append("teams")
            await gateway.teams.start()
            # 3. Bind, the public listener then the admin one. uvicorn exits
            #    (SystemExit) when a port is taken.
            if not self.config.models:
                log.warning("no models configured (models): every request is a 404")
            if not admin_on_public(self.config) and self.admin is None:
                log.warning(
                    "keys are on and admin_port is not set: /metrics, /metrics/json, "
                    "/admin/workers and /admin/usage are served nowhere (set admin_port to "
                    "serve them)"
                )
            await _bind(self.uvicorn, self.reuse_port)
            self._opened.append("http")
            if self.admin is not None:
                await _bind(self.admin)
                self._opened.append("admin")
            servers = [self.uvicorn] if self.admin is None else [self.uvicorn, self.admin]
            self._dates = asyncio.ensure_future(keep_dates(servers))
        except BaseException:
            await self._close()
            raise
        # 4. The batches' keeper: runs to resume, cancels from other replicas.
        gateway.batches.start()
        self._opened.append("batches")
        # 5. Ready for traffic.
        gateway.ready = True

    async def stop(self, grace: float | None = None) -> None:
        """Drains and closes, in order; `grace` (default `drain_timeout`)
        bounds the drain."""
        gateway = self.gateway
        # 1. Unready: /ready answers 503, so load balancers stop sending.
        gateway.ready = False
        # 2. Drain: refuse new requests, let those in flight finish, cancel the rest.
        await gateway.inflight.drain(self.config.drain_timeout if grace is None else grace)
        # 3-5. Stop serving HTTP, then close the teams and the fleet.
        await self._close()

    async def _close(self) -> None:
        if self._dates is not None:
            self._dates.cancel()
            self._dates = None
        if "batches" in self._opened:  # drained: the runs' lines have ended
            await self.gateway.batches.close()
        if "http" in self._opened:
            await self.uvicorn.shutdown()
        if "admin" in self._opened and self.admin is not None:
            await self.admin.shutdown()
        if "teams" in self._opened:
            await self.gateway.teams.close()
        if "fleet" in self._opened:
            await self.gateway.fleet.close()
        self._opened.clear()

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Serves until SIGTERM or SIGINT, then stops; a second signal cuts the
        drain short. `on_ready` is called once it is ready. The signals are taken from
        before the start: one that comes while it starts (a pod deleted as it comes up)
        stops the gateway once it is up, drained, rather than killing it half open."""
        async with _StopSignals() as signals:
            await self.start()
            # What the start built lives as long as the process: out of the cyclic
            # collector's reach from here, a full collection walks only what requests
            # made (make bench's gateway: 17-26 ms a full collection -> under 1 ms, TTFT
            # p99 at 32 streams 25 -> 9.5 ms). Here, not in `start`: tests start many
            # gateways in one process, whose garbage a freeze would keep.
            gc.freeze()
            if on_ready is not None:
                on_ready()
            await signals.next()
            log.info("stopping: draining for up to %gs", self.config.drain_timeout)
            drain = asyncio.ensure_future(self.gateway.inflight.drain(self.config.drain_timeout))
            self.gateway.ready = False
            second = asyncio.ensure_future(signals.next())
            await asyncio.wait((drain, second), return_when=asyncio.FIRST_COMPLETED)
            second.cancel()
            if not drain.done():
                log.warning("second signal: the drain is cut short")
                drain.cancel()
                for request in list(self.gateway.inflight.running):
                    request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        await self._close()


async def keep_dates(servers: list[uvicorn.Server]) -> None:
    """The Date header of every response, set at each second's turn, as uvicorn's main
    loop sets it (the gateway runs uvicorn's startup and shutdown, not that loop):
    HTTP/1.1 asks it of a server with a clock."""
    while True:
        date = [(b"date", formatdate(usegmt=True).encode())]
        for server in servers:
            server.server_state.default_headers = date + server.config.encoded_headers
        await asyncio.sleep(1.0 - time.time() % 1.0)


async def _bind(server: uvicorn.Server, reuse_port: bool = False) -> None:
    """Binds `server`'s listener (the parts are started here, not by a lifespan);
    with `reuse_port`, on a socket that shares its port with other processes."""
    settings = server.config
    settings.load()
    server.lifespan = LifespanOff(settings)
    if not reuse_port:
        await server.startup()
        return
    try:
        sock = shared_port_socket(settings.host, settings.port)
    except OSError as error:
        log.error("cannot bind %s:%d: %s", settings.host, settings.port, error)
        raise SystemExit(1) from error
    await server.startup(sockets=[sock])


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` with SO_REUSEPORT (not yet listening): the
    kernel spreads new connections over every process listening on such a socket."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _StopSignals:
    """SIGTERM and SIGINT as events on the running loop, for the `async with`."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._queue: asyncio.Queue[int] = asyncio.Queue()

    async def __aenter__(self) -> _StopSignals:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._queue.put_nowait, sig)
        return self

    async def __aexit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    async def next(self) -> int:
        """The next signal received."""
        return await self._queue.get()


async def serve_gateway(config: Config, config_file: str | None = None) -> None:
    """The gateway until SIGINT or SIGTERM (`config_file`: where `config` was read, to
    read again when it changes)."""
    await GatewayServer(config, config_file=config_file).serve()


async def serve_demo(config: Config, engine: Engine) -> None:
    """The gateway with an embedded demo worker on a loopback port, and a tensor worker
    serving the pure-Python demo tensor model (KServe v2 gRPC) on another."""
    worker = WorkerServer(engine, "127.0.0.1", 0)
    await worker.start()
    tensors, tensor_port = await start_tensor_server(DemoTensorEngine(), "127.0.0.1", 0)
    model = ModelConfig(name=engine.model, workers=(worker.address,))
    tensor_model = ModelConfig(
        name=DEMO_TENSOR_MODEL,
        kind="tensor",
        workers=(f"127.0.0.1:{tensor_port}",),
        upstream="kserve-grpc",
    )
    try:
        await serve_gateway(Config(**{**config.__dict__, "models": (model, tensor_model)}))
    finally:
        await tensors.stop(1.0)
        await worker.stop(grace=1.0)
