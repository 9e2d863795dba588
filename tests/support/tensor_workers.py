"""Our own tensor worker in-process: the pure-Python demo engine behind the KServe v2 gRPC
server (gateway/worker/tensor/server.py) on the tests' server loop, with a servicer that
records each call's gRPC metadata and an engine that holds its calls until released."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from gateway.protocol.tls import ServerTLS
from gateway.worker.tensor.demo import DemoTensorEngine
from gateway.worker.tensor.engine import RawTensor
from gateway.worker.tensor.server import TensorServicer, start_tensor_server
from tests.support.servers import ServerLoop
from tests.support.waiting import HANG_GUARD


class RecordingServicer(TensorServicer):
    """Keeps each ModelInfer's metadata by its x-request-id."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.metadata: dict[str, dict[str, str]] = {}

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        seen = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.metadata[seen.get("x-request-id", "")] = seen
        return await super().ModelInfer(request, context)


class GatedEngine(DemoTensorEngine):
    """The demo model, each call held until `release` is set (`started` says one arrived)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    async def infer(
        self, inputs: dict[str, RawTensor], outputs: list[str]
    ) -> list[tuple[str, RawTensor]]:
        self.started.set()
        await asyncio.to_thread(self.release.wait, HANG_GUARD)
        return await super().infer(inputs, outputs)


class TensorWorkers:
    """Started tensor servers on the loop; `stop` stops them all."""

    def __init__(self, server_loop: ServerLoop) -> None:
        self.loop = server_loop
        self.servers: list[Any] = []

    def start(
        self,
        engine: Any = None,
        tls: ServerTLS | None = None,
        servicer: TensorServicer | None = None,
    ) -> str:
        """Serves `engine` (the demo model by default); returns its address."""
        engine = engine or DemoTensorEngine()
        server, port = self.loop.call(
            start_tensor_server(engine, "127.0.0.1", 0, tls=tls, servicer=servicer)
        )
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        for server in self.servers:
            self.loop.call(server.stop(0))
        self.servers.clear()
