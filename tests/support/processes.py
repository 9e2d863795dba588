"""The gateway's commands as real processes on free loopback ports, and waits for them to listen."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.waiting import HANG_GUARD, wait_until


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> int:
    """A free loopback port whose next `count - 1` are free too (a data-parallel vLLM
    server's ranks each bind their KV-event publisher at a port past the first)."""
    while True:
        port = free_port()
        probes = [socket.socket() for _ in range(count - 1)]
        try:
            for offset, probe in enumerate(probes, 1):
                probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        return port


@contextmanager
def running(
    *args: str, output: list[str] | None = None, returncode: int = 0
) -> Iterator[subprocess.Popen]:
    """`python -m gateway ARGS` until the block ends; then SIGTERM, and it must exit with
    `returncode` (0; a block that kills it says how) (`output`: gets what it wrote,
    stdout and stderr together)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        written = process.communicate(timeout=HANG_GUARD)[0]
        if output is not None:
            output.append(written)
    assert process.returncode == returncode, written


def config_file(tmp_path: Path, port: int, model: str, worker_port: int, extra: str = "") -> str:
    """A gateway config serving `model` from one worker on loopback."""
    path = tmp_path / "config.yaml"
    path.write_text(
        f"host: 127.0.0.1\nport: {port}\nlog_level: warning\n{extra}"
        f"models:\n  - name: {model}\n    workers: ['127.0.0.1:{worker_port}']\n"
    )
    return str(path)


@contextmanager
def worker_process(port: int, *args: str) -> Iterator[subprocess.Popen]:
    """A demo worker in a process of its own."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "worker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: listening(port), "the worker to listen")
        yield process
    finally:
        process.kill()
        process.wait(HANG_GUARD)


def listening(port: int) -> bool:
    """Whether something accepts connections on the loopback port."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(port: int, process: subprocess.Popen) -> None:
    """Waits until `process` listens on `port`; fails at once if it exits."""
    end = time.monotonic() + HANG_GUARD
    while not listening(port):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < end, "the process never listened"
        time.sleep(0.05)


def wait_ready(url: str, process: subprocess.Popen) -> None:
    """Waits until the gateway at `url` answers /ready with 200; fails at once if it exits."""
    end = time.monotonic() + HANG_GUARD
    while time.monotonic() < end:
        assert process.poll() is None, process.communicate()[0]
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the gateway never became ready")
