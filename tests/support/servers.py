"""Real servers for the tests: gRPC workers and the gateway under uvicorn, on
loopback ports, on one uvloop event loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import uvloop

from gateway.config import Config, ModelConfig
from gateway.fleet.routing import Router
from gateway.lifecycle import Gateway as GatewayParts
from gateway.lifecycle import GatewayServer
from gateway.upstreams.openai_http.connections import _RawCall
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.server import WorkerServer
from tests.support.scripted_worker import SCRIPTED_MODEL, ScriptedWorker
from tests.support.waiting import HANG_GUARD, wait_until


class ServerLoop:
    """An event loop in a thread; `call` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = HANG_GUARD) -> Any:
        """Runs `coro` on the loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stops the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(HANG_GUARD)


@dataclass
class Workers:
    """The workers every gateway of a test session points at."""

    demo: WorkerServer
    demo_engine: DemoEngine
    slow: WorkerServer
    slow_engine: DemoEngine
    scripted: ScriptedWorker


@dataclass
class Gateway:
    """A running gateway: its base URL (and its admin listener's, with
    `admin_port`) and its state, for leak checks."""

    url: str
    state: GatewayParts
    stop: Callable[[], None]
    admin_url: str | None = None

    def router(self, model: str) -> Router:
        """The `routing:` of `model`: its KV index, its subscribers, its last decision."""
        router = self.state.fleet.models[model].router
        assert router is not None, f"{model} has no routing"
        return router


async def start_workers() -> Workers:
    """Starts the session's workers (run it on the server loop)."""
    demo_engine = DemoEngine(max_context=64)
    slow_engine = DemoEngine("furnace-slow", max_context=4096, token_delay=0.05)
    demo, slow = WorkerServer(demo_engine), WorkerServer(slow_engine)
    scripted = ScriptedWorker()
    for server in (demo, slow, scripted):
        await server.start()
    return Workers(demo, demo_engine, slow, slow_engine, scripted)


def make_config(workers: Workers, **overrides: Any) -> Config:
    """A config serving the test workers on a free port."""
    models = (
        ModelConfig(DEMO_MODEL, workers=(workers.demo.address,)),
        ModelConfig("furnace-slow", workers=(workers.slow.address,)),
        ModelConfig(SCRIPTED_MODEL, workers=(workers.scripted.address,)),
        ModelConfig("resnet-50", kind="tensor"),
    )
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        # the fault tests fail one worker on purpose, again and again: no ejection
        # here (tests/test_fleet.py covers it with gateways of their own)
        "eject_after_failures": 1_000_000,
    }
    settings.update(overrides)
    settings.setdefault("models", models)
    return Config(**settings)


def start_gateway(
    server_loop: ServerLoop, config: Config, config_file: str | None = None
) -> Gateway:
    """Starts the gateway under uvicorn on the server loop (`config_file`: the file
    `config` was read from, which it reads again when it changes)."""
    server = GatewayServer(config, config_file=config_file)
    server_loop.call(server.start())
    url = f"http://127.0.0.1:{server.port}"
    admin = None if server.admin_port is None else f"http://127.0.0.1:{server.admin_port}"
    return Gateway(url, server.gateway, lambda: server_loop.call(server.stop()), admin)


def worker_states(gw: Gateway, model: str, tier: str = "workers") -> dict[str, str]:
    """The state of each of `model`'s workers (`tier` "prefill_workers": its prefill
    workers), by address, as `/admin/workers` shows them."""
    view = next(m for m in gw.state.fleet.snapshot()["models"] if m["name"] == model)
    return {w["address"]: w["state"] for w in view[tier]}


def assert_nothing_left(gw: Gateway, workers: Workers | None) -> None:
    """Every slot free, nothing queued, no call outstanding on any worker (nor
    counted among the plain-HTTP calls that rest their sockets), no generation
    running."""
    wait_until(lambda: gw.state.slots.in_use == 0, "all slots to be free")
    wait_until(lambda: not gw.state.inflight.running, "no request in flight")
    queue = gw.state.slots.queue
    wait_until(lambda: queue is None or queue.waiting() == 0, "no request queued")
    pools = [*gw.state.fleet.models.values(), *gw.state.fleet.own]  # prefill workers' too
    wait_until(
        lambda: all(w.outstanding == 0 for p in pools for w in p.workers.values()),
        "no outstanding worker calls",
    )
    wait_until(
        lambda: all(
            getattr(w.upstream, "multiplexed", 0) == 0 for p in pools for w in p.workers.values()
        ),
        "no request open on a worker's multiplexed call",
    )
    wait_until(lambda: _RawCall.reading == 0, "no plain-HTTP upstream call counted as reading")
    if workers is not None:
        wait_until(lambda: workers.scripted.active == 0, "the scripted worker to be idle")
        wait_until(lambda: workers.demo_engine.running == 0, "the demo engine to be idle")
        wait_until(lambda: workers.slow_engine.running == 0, "the slow engine to be idle")
