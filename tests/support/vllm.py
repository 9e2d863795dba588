"""Real vLLM servers (its CPU build) for the tests, from their own virtualenv
(.tools/vllm, made by deploy/install-tools.sh), serving the tiny model built on the
spot: the gRPC server (`vllm.grpc.engine.VllmEngine`), the OpenAI HTTP server, and
our worker with `--engine vllm`. Each starts in 15-20 s and holds 1.3-2.4 GiB, so
the session fixtures start each once, when a test first asks for it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.processes import free_port
from tests.support.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent.parent
VLLM_PYTHON = ROOT / ".tools" / "vllm" / "bin" / "python"
#: Seconds a vLLM server may take to come up on a loaded 2-core machine.
START_GUARD = 240.0
#: The model's context as the servers run it (vLLM's --max-model-len).
MAX_MODEL_LEN = 1024
#: vLLM's lean CPU settings (shared notes): 1 GiB of KV cache, one process, no compile.
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "SMG_VLLM_SERVICER_WARMUP": "off",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
ENGINE_ARGS = (
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
    "--max-model-len",
    str(MAX_MODEL_LEN),
)


def vllm_python() -> Path:
    """The vLLM environment's interpreter; fails (never skips) when it is missing."""
    if not VLLM_PYTHON.exists():
        raise RuntimeError(
            f"{VLLM_PYTHON.relative_to(ROOT)} is missing: run `bash deploy/install-tools.sh`"
        )
    return VLLM_PYTHON


def build_vllm_model(path: Path) -> Path:
    """The tiny model in shapes vLLM's CPU kernels take (head size 64, bfloat16)."""
    return build_tiny_model(path, for_vllm=True)


class VllmProcess:
    """One server process: started with `start`, ready when `wait_ready` returns."""

    def __init__(
        self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.args = args
        self.log = log
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> VllmProcess:
        """Starts the server; it gets a SIGTERM (its clean shutdown, which stops its
        engine process too) when the test process dies, even by SIGKILL, so a run cut
        by a timeout leaves no vLLM behind (util-linux's setpriv, where there is one)."""
        env = {**os.environ, **ENV, **self.env}
        setpriv = shutil.which("setpriv")
        args = [setpriv, "--pdeathsig", "TERM", *self.args] if setpriv else self.args
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
            )
        return self

    def check_alive(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM server exited ({self.process.returncode}):\n{tail}")

    def stop(self) -> None:
        """SIGTERM (a clean shutdown takes 5-10 s), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


#: The OpenAI server's tools and structured outputs, as the shared notes found them to
#: hold on a random model: the hermes parser (the tiny model's template writes
#: `<tool_call>`), xgrammar without free whitespace (else JSON pads to `max_tokens`), and
#: tool arguments enforced by the grammar for `required` and named tool choices.
HTTP_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
HTTP_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def start_http_server(
    model: Path, log_dir: Path, name: str = "tiny-vllm", extra: tuple[str, ...] = ()
) -> VllmProcess:
    """vLLM's OpenAI server on a free loopback port, ready (GET /health is 200), with
    tool calls and structured outputs on, and `extra` engine options."""
    port = free_port()
    args = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ENGINE_ARGS,
        *HTTP_ARGS,
        *extra,
    ]
    server = VllmProcess(args, port, log_dir / "vllm-http.log", HTTP_ENV).start()
    end = time.monotonic() + START_GUARD
    while time.monotonic() < end:
        server.check_alive()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"vLLM's HTTP server did not start in {START_GUARD:g} s")


#: The gRPC server's structured outputs (the gateway sends the schemas: response_format
#: and forced tool calls): xgrammar without free whitespace, as for the HTTP server.
GRPC_ARGS = HTTP_ARGS[HTTP_ARGS.index("--structured-outputs-config") :]


def start_grpc_server(model: Path, log_dir: Path, extra: tuple[str, ...] = ()) -> VllmProcess:
    """vLLM's own gRPC server (service vllm.grpc.engine.VllmEngine) on a free loopback
    port, ready (its grpc.health.v1 says SERVING), with structured outputs on and
    `extra` engine options."""
    port = free_port()
    args = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.grpc_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *ENGINE_ARGS,
        *GRPC_ARGS,
        *extra,
    ]
    server = VllmProcess(args, port, log_dir / "vllm-grpc.log").start()
    wait_grpc_serving(server)
    return server


def wait_grpc_serving(server: VllmProcess, service: str = "") -> None:
    """Waits until the server's grpc.health.v1 answers SERVING for `service`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    end = time.monotonic() + START_GUARD
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < end:
            server.check_alive()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"the vLLM gRPC server did not start in {START_GUARD:g} s")


__all__ = [
    "MAX_MODEL_LEN",
    "VllmProcess",
    "build_vllm_model",
    "start_grpc_server",
    "start_http_server",
    "vllm_python",
    "wait_grpc_serving",
]
