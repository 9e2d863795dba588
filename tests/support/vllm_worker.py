"""Our worker with `--engine vllm` (vLLM's AsyncLLM in-process), started from vLLM's
virtualenv with vLLM's lean CPU settings, as the tests run it; and what it says about
itself: its health (recorded from spawn until SERVING), `Describe`, and the requests
its engine aborted (its log). Starts in 20-30 s (importing vLLM, then the engine),
holds about 2.4 GiB. `open_front` puts a gateway and clients in front of such workers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import ModelConfig
from gateway.protocol.v1 import engine_pb2, engine_pb2_grpc
from gateway.worker.server import SERVICE_NAME
from tests.support.processes import free_port
from tests.support.servers import Gateway, ServerLoop, Workers, make_config, start_gateway
from tests.support.vllm import ENGINE_ARGS, START_GUARD, VllmProcess, vllm_python
from tests.support.waiting import HANG_GUARD, wait_until

#: The model name the worker serves.
MODEL = "tiny-vllm-engine"
#: The name the same model serves as an embedding model (vLLM's pooling runner).
EMBED_MODEL = "tiny-vllm-embed"
#: vLLM's options that make the tiny causal LM an embedding model (last-token pooling).
EMBED_OPTIONS = ("--runner", "pooling", "--convert", "embed")
#: vLLM's --max-num-seqs for the worker: the capacity `Describe` reports.
MAX_NUM_SEQS = 16
#: What the worker logs for each request its engine aborted (gateway/worker/vllm_engine.py).
ABORTED = "aborted in the engine"


class VllmWorker(VllmProcess):
    """The worker process; `health` lists the statuses it reported while starting."""

    def __init__(self, args: list[str], port: int, log: Path) -> None:
        super().__init__(args, port, log)
        self.health: list[str] = []

    def describe(self) -> engine_pb2.DescribeResponse:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            return stub.Describe(engine_pb2.DescribeRequest(), timeout=10)

    def load(self) -> int:
        """Requests in the engine, by vLLM's own count."""
        return int(self.describe().load)

    def aborted(self) -> int:
        """Requests the engine aborted so far."""
        return self.log.read_text(errors="replace").count(ABORTED)

    def wait_serving(self) -> None:
        """Polls the health of our Engine service from spawn until SERVING, recording
        each status it reports (NOT_SERVING while the engine starts)."""
        end = time.monotonic() + START_GUARD
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < end:
                self.check_alive()
                try:
                    reply = stub.Check(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2
                    )
                except grpc.RpcError:
                    time.sleep(0.1)
                    continue
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if not self.health or self.health[-1] != status:
                    self.health.append(status)
                if status == "SERVING":
                    return
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the vLLM worker did not start in {START_GUARD:g} s")


def start_vllm_worker(model: Path, log_dir: Path, *options: str, name: str = MODEL) -> VllmWorker:
    """`furnace-gateway worker --engine vllm` on a free loopback port, ready, serving
    the model folder as `name`."""
    port = free_port()
    args = [
        str(vllm_python()),
        "-m",
        "gateway",
        "worker",
        "--engine",
        "vllm",
        "--model-path",
        str(model),
        "--model",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ENGINE_ARGS,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        *options,
    ]
    worker = VllmWorker(args, port, log_dir / "vllm-worker.log")
    worker.start()
    worker.wait_serving()
    return worker


@dataclass
class Front:
    """A worker, a gateway in front of it (and of any more models), and clients."""

    worker: VllmWorker
    gateway: Gateway
    sdk: openai.OpenAI
    http: httpx.Client
    tokenizer: Any


@contextlib.contextmanager
def open_front(
    server_loop: ServerLoop,
    workers: Workers,
    worker: VllmWorker,
    model: Path,
    more: dict[str, VllmWorker] | None = None,
) -> Iterator[Front]:
    """The gateway serving `worker` as MODEL (and `more` by name), listing them all."""
    from transformers import AutoTokenizer

    served = {MODEL: worker, **(more or {})}
    models = tuple(ModelConfig(n, workers=(f"127.0.0.1:{w.port}",)) for n, w in served.items())
    gw = start_gateway(server_loop, make_config(workers, models=models))
    sdk = openai.OpenAI(
        base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    )
    http = httpx.Client(base_url=gw.url, timeout=HANG_GUARD)
    try:  # closed even when the gateway never lists the workers
        wait_until(
            lambda: set(served) <= {m.id for m in sdk.models.list().data},
            "the gateway to list the workers",
        )
        yield Front(worker, gw, sdk, http, AutoTokenizer.from_pretrained(model))
    finally:
        http.close()
        sdk.close()
        gw.stop()


__all__ = [
    "ABORTED",
    "EMBED_MODEL",
    "EMBED_OPTIONS",
    "MAX_NUM_SEQS",
    "MODEL",
    "Front",
    "VllmWorker",
    "open_front",
    "start_vllm_worker",
]
