"""Real vLLM servers (its CPU build) for the tests, from their own virtualenv
(.tools/vllm, made by deploy/install-tools.sh), serving the tiny model built on the
spot: the gRPC server (`vllm.grpc.engine.VllmEngine`), the OpenAI HTTP server, and
our worker with `--engine vllm`. Each starts in 15-20 s and holds 1.3-2.4 GiB, so
the session fixtures start each once, when a test first asks for it. `restart` starts a
server again on its port (a new engine: its cache and KV-event publisher start empty)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

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
    """One server process: started with `start`, ready when `wait_ready` returns; a
    `with` block stops it at its end."""

    def __init__(
        self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.args = args
        self.log = log
        self.env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        #: Waits until the server answers (set by the `start_*` helper that made it).
        self.ready: Callable[[VllmProcess], None] | None = None

    def start(self) -> VllmProcess:
        """Starts the server; it gets a SIGTERM (its clean shutdown, which stops its
        engine process too) when the test process dies, even by SIGKILL, so a run cut
        by a timeout leaves no vLLM behind (util-linux's setpriv, where there is one)."""
        env = {**os.environ, **ENV, **self.env}
        setpriv = shutil.which("setpriv")
        args = [setpriv, "--pdeathsig", "TERM", *self.args] if setpriv else self.args
        with self.log.open("ab") as out:  # a restart's output follows the first run's
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def restart(self) -> VllmProcess:
        """Stops the server and starts it again with the same options on the same port
        (its KV-event endpoint included), ready: a new engine, its cache empty."""
        self.stop()
        self.start()
        if self.ready is not None:
            self.ready(self)
        return self


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


def kv_events_args(port: int | None = None, replay: int | None = None) -> tuple[str, ...]:
    """Prefix caching, and KV events published over ZMQ on `port` (a free one when None),
    with vLLM's replay socket on `replay` when given; bind addresses, or vLLM connects
    out and loses every event."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port or free_port()}",
    }
    if replay is not None:
        config["replay_endpoint"] = f"tcp://*:{replay}"
    return ("--enable-prefix-caching", "--kv-events-config", json.dumps(config))


def nixl_args(role: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """vLLM's NixlConnector in `role` (`kv_producer`: a server that prefills;
    `kv_consumer`: one that decodes, pulling the blocks): the engine's options, and its
    variables, its side channel (where decode servers ask for blocks) on a free port.

    In float32: on a CPU with AMX, vLLM 0.32's CPU build picks its AMX attention kernel for
    bfloat16, and a decode engine running it over blocks the connector pulled dies of an
    illegal instruction (the same engine without the connector does not); its kernel for
    float32 runs the transfer on any x86 CPU."""
    config = json.dumps({"kv_connector": "NixlConnector", "kv_role": role})
    options = ("--kv-transfer-config", config, "--dtype", "float32")
    return options, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


def _http_command(model: Path, name: str, port: int, options: tuple[str, ...]) -> list[str]:
    """vLLM's OpenAI server of `model` as `name` on loopback `port`, with `options`."""
    return [
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
        *options,
    ]


def start_http_server(
    model: Path,
    log_dir: Path,
    name: str = "tiny-vllm",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> VllmProcess:
    """vLLM's OpenAI server on a free loopback port, ready (GET /health is 200), with
    tool calls and structured outputs on, and `extra` engine options (and variables)."""
    options = (*ENGINE_ARGS, *HTTP_ARGS, *extra)
    return _start(
        lambda port: _http_command(model, name, port, options),
        log_dir / "vllm-http.log",
        wait_http_ready,
        {**HTTP_ENV, **(env or {})},
    )


def start_http_servers(
    model: Path, log_dir: Path, options: list[tuple[str, ...]]
) -> list[VllmProcess]:
    """vLLM's OpenAI servers of one data-parallel group (each with its `options`: its
    ranks), started at once, as its nodes' servers wait for each other's engines, on
    free loopback ports, all ready; all stopped when one fails to start."""
    started: list[VllmProcess] = []
    try:
        for number, extra in enumerate(options):
            port = free_port()
            args = _http_command(model, "tiny-vllm", port, (*ENGINE_ARGS, *extra))
            started.append(VllmProcess(args, port, log_dir / f"vllm-{number}.log").start())
        for server in started:
            wait_http_ready(server)
    except BaseException:  # a failed start, a hang guard, an interrupt: none left running
        for server in started:
            server.stop()
        raise
    return started


#: A Whisper's decoder reads at most 448 tokens: its context, as vLLM runs it.
WHISPER_LEN = 448


def start_lean_http_server(
    model: Path,
    log_dir: Path,
    name: str,
    max_len: int = WHISPER_LEN,
    extra: tuple[str, ...] = (),
) -> VllmProcess:
    """vLLM's OpenAI server with its lean CPU settings alone (no tool or structured-output
    options), context `max_len`, and `extra` engine options, on a free loopback port,
    ready: for a speech-to-text model (tests/support/tiny_whisper.py: its
    `/v1/audio/transcriptions` and `/translations`), an audio LLM
    (tests/support/tiny_audio_lm.py: chats with sounds), an embedding model."""
    lean = ENGINE_ARGS[: ENGINE_ARGS.index("--max-model-len")]
    options = ("--dtype", "bfloat16", *lean, "--max-model-len", str(max_len), *extra)
    return _start(
        lambda port: _http_command(model, name, port, options),
        log_dir / f"vllm-{name}.log",
        wait_http_ready,
    )


#: Starts of a server whose port was taken meanwhile: vLLM builds its engine (tens of
#: seconds) before its server binds the port `free_port` found free, and the kernel may
#: give it to another socket first (seen in CI: "Address already in use").
START_TRIES = 3
_PORT_TAKEN = "Address already in use"


def _start(
    args: Callable[[int], list[str]],
    log: Path,
    ready: Callable[[VllmProcess], None],
    env: dict[str, str] | None = None,
) -> VllmProcess:
    """The server started on a free port and ready; on another port when the first was
    taken before the server bound it."""
    for attempt in range(1, START_TRIES + 1):
        port = free_port()
        logged = log.stat().st_size if log.exists() else 0
        server = VllmProcess(args(port), port, log, env).start()
        server.ready = ready
        try:
            ready(server)
            return server
        except RuntimeError:
            server.stop()
            with log.open("rb") as out:
                out.seek(logged)
                taken = _PORT_TAKEN in out.read().decode(errors="replace")
            if not taken or attempt == START_TRIES:
                raise
        except BaseException:  # a test's hang guard (pytest-timeout) or an interrupt
            server.stop()  # never a server left running for the next module's tests
            raise
    raise AssertionError("unreachable")


def _wait_ready(server: VllmProcess, ready: Callable[[], bool], what: str) -> None:
    """Asks `ready` every 0.5 s until it says yes; stops the server and fails when it
    exits or after `START_GUARD` seconds."""
    end = time.monotonic() + START_GUARD
    while time.monotonic() < end:
        server.check_alive()
        if ready():
            return
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{what} did not start in {START_GUARD:g} s")


def wait_http_ready(server: VllmProcess) -> None:
    """Waits until the OpenAI server's GET /health answers 200."""

    def healthy() -> bool:
        try:
            url = f"http://127.0.0.1:{server.port}/health"
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait_ready(server, healthy, "vLLM's HTTP server")


#: The gRPC server's structured outputs (the gateway sends the schemas: response_format
#: and forced tool calls): xgrammar without free whitespace, as for the HTTP server.
GRPC_ARGS = HTTP_ARGS[HTTP_ARGS.index("--structured-outputs-config") :]


def start_grpc_server(
    model: Path,
    log_dir: Path,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> VllmProcess:
    """vLLM's own gRPC server (service vllm.grpc.engine.VllmEngine) on a free loopback
    port, ready (its grpc.health.v1 says SERVING), with structured outputs on and
    `extra` engine options (and variables)."""

    def args(port: int) -> list[str]:
        return [
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

    return _start(args, log_dir / "vllm-grpc.log", wait_grpc_serving, env)


def wait_grpc_serving(server: VllmProcess, service: str = "") -> None:
    """Waits until the server's grpc.health.v1 answers SERVING for `service`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        _wait_ready(server, serving, "the vLLM gRPC server")


__all__ = [
    "MAX_MODEL_LEN",
    "VllmProcess",
    "build_vllm_model",
    "start_grpc_server",
    "start_http_server",
    "vllm_python",
    "wait_grpc_serving",
    "wait_http_ready",
]
