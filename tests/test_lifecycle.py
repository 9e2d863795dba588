"""The gateway's start and stop: a start that fails closes what it opened; a
draining gateway refuses new requests as rejections with reason `draining`
(they were once miscounted as engine errors), while the requests it holds finish;
a serving process freezes what its start built (gc), and takes a SIGTERM that comes
while it starts once it is up; a process of the package runs grpc's iomgr client and
listener unless its operator says otherwise."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gateway import GRPC_EXPERIMENTS
from gateway.config import Config, ModelConfig
from gateway.lifecycle import GatewayServer
from tests.support.metrics import scrape

GUARD = 30.0


def _a_stream_under_way(url: str) -> tuple[threading.Thread, list[str]]:
    """A slow streamed completion read on a thread, once its first line came: the
    thread, and the lines it reads."""
    body = {"model": "furnace-slow", "prompt": "a b c d e f g h", "stream": True}
    first_line = threading.Event()
    lines: list[str] = []

    def hold_a_stream() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=GUARD) as r:
            for line in r.iter_lines():
                lines.append(line)
                first_line.set()

    holder = threading.Thread(target=hold_a_stream)
    holder.start()
    assert first_line.wait(GUARD)
    return holder, lines


def test_a_request_refused_while_draining_counts_as_a_draining_rejection(gateway_with, server_loop):
    gw = gateway_with()
    holder, lines = _a_stream_under_way(gw.url)
    drain = asyncio.run_coroutine_threadsafe(gw.state.inflight.drain(GUARD), server_loop.loop)

    refused = httpx.post(
        gw.url + "/v1/completions", json={"model": "furnace-demo", "prompt": "hi"}, timeout=GUARD
    )
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert httpx.get(gw.url + "/ready", timeout=GUARD).status_code == 503

    holder.join(GUARD)
    drain.result(GUARD)
    lines = [line for line in lines if line]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    samples = scrape(gw.url)
    labels = (("model", "furnace-demo"), ("reason", "draining"))
    assert samples[("furnace_gateway_rejections_total", labels)] == 1
    outcome = (
        ("model", "furnace-demo"),
        ("outcome", "rejected"),
        ("route", "/v1/completions"),
        ("status", "503"),
    )
    assert samples[("furnace_gateway_requests_total", outcome)] == 1
    assert not any(
        name == "furnace_gateway_requests_total" and dict(labels).get("outcome") == "engine_error"
        for name, labels in samples
    )


def test_a_stream_the_drain_cuts_ends_as_a_shutdown_not_an_engine_error(gateway_with, server_loop):
    """A drain whose grace runs out cuts the answers in flight: the client reads that the
    gateway shut down (not that the engine failed), and the request counts as `shutdown`,
    which the error-ratio alert leaves out (a rollout is not an outage)."""
    gw = gateway_with()
    holder, lines = _a_stream_under_way(gw.url)
    asyncio.run_coroutine_threadsafe(gw.state.inflight.drain(0.05), server_loop.loop).result(GUARD)
    holder.join(GUARD)
    errors = [line for line in lines if '"error"' in line]
    assert len(errors) == 1 and '"gateway_shutdown"' in errors[0]
    assert "shut down before the answer was complete" in errors[0]
    outcomes = {
        dict(labels)["outcome"]
        for (name, labels), value in scrape(gw.url).items()
        if name == "furnace_gateway_requests_total" and value
    }
    assert outcomes == {"shutdown"}


def test_a_start_that_fails_to_bind_closes_what_it_opened(server_loop, workers):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    model = ModelConfig("furnace-demo", workers=(workers.demo.address,))
    config = Config(host="127.0.0.1", port=port, log_level="critical", models=(model,))

    async def start_on_a_taken_port() -> tuple[int, int, bool]:
        server = GatewayServer(config)
        with pytest.raises(SystemExit):
            await server.start()
        watching = server.gateway.fleet.models["furnace-demo"].workers
        return len(watching), server.gateway.fleet.background_tasks, server.gateway.ready

    try:
        workers_seen, tasks_left, ready = server_loop.call(start_on_a_taken_port())
    finally:
        taken.close()
    assert workers_seen == 1  # the fleet had started: it found its worker
    assert tasks_left == 0, "the fleet's watchers were left running"
    assert not ready


def test_a_serving_process_freezes_what_its_start_built():
    # `serve` (a process of its own) moves what the start built out of the cyclic
    # collector's reach; the in-process gateways of these tests start without it
    code = (
        "import gc, os, signal\n"
        "from gateway.config import Config\n"
        "from gateway.lifecycle import GatewayServer, run\n"
        "async def main():\n"
        "    server = GatewayServer(Config(host='127.0.0.1', port=0, log_level='warning'))\n"
        "    def ready():\n"
        "        print('frozen', gc.get_freeze_count(), flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    await server.serve(on_ready=ready)\n"
        "run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=GUARD
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[1]) > 10_000  # the modules, the app, the fleet


def test_a_signal_while_the_gateway_starts_stops_it_once_it_is_up(tmp_path: Path):
    # its worker takes the connection and says nothing: the start waits for the first
    # health report (2 s), and the signal comes during that wait
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.settimeout(GUARD)
        config = tmp_path / "config.yaml"
        config.write_text(
            "host: 127.0.0.1\nport: 0\nlog_level: info\nmodels:\n  - name: quiet\n"
            f"    workers: ['127.0.0.1:{silent.getsockname()[1]}']\n"
        )
        command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
        gateway = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            health_check, _ = silent.accept()  # the fleet's start is under way
            with health_check:
                gateway.send_signal(signal.SIGTERM)
                output = gateway.communicate(timeout=GUARD)[0]
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait()
    assert gateway.returncode == 0, output
    assert "stopping: draining" in output


_GRPC_CALL = (
    "import asyncio, os\n"
    "import gateway, grpc\n"
    "from grpc_health.v1 import health, health_pb2, health_pb2_grpc\n"
    "async def main():\n"
    "    server = grpc.aio.server()\n"
    "    port = server.add_insecure_port('127.0.0.1:0')\n"
    "    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)\n"
    "    await server.start()\n"
    "    async with grpc.aio.insecure_channel(f'127.0.0.1:{port}') as channel:\n"
    "        stub = health_pb2_grpc.HealthStub(channel)\n"
    "        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)\n"
    "    await server.stop(None)\n"
    "    print(repr(os.environ['GRPC_EXPERIMENTS']), flush=True)\n"
    "asyncio.run(main())\n"
)


def _grpc_process(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    return subprocess.run(
        [sys.executable, "-c", _GRPC_CALL],
        capture_output=True,
        text=True,
        timeout=GUARD,
        env={**environment, **env},
    )


def test_a_process_of_the_package_runs_grpc_iomgr_client_and_listener():
    # grpc reads GRPC_EXPERIMENTS when first imported: importing the package sets
    # it first; a grpc release that no longer knows an experiment says so on stderr
    done = _grpc_process({})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == repr(GRPC_EXPERIMENTS)
    assert "experiment" not in done.stderr.lower(), done.stderr


def test_an_operators_own_grpc_experiments_are_left_alone():
    done = _grpc_process({"GRPC_EXPERIMENTS": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "''"
