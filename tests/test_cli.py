"""The commands as a newcomer runs them: real processes, real clients."""

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from tests.conftest import HANG_GUARD, wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running(*args: str) -> Iterator[subprocess.Popen]:
    """`python -m gateway ARGS` until the block ends; then SIGTERM, and it must exit 0."""
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
        output = process.communicate(timeout=HANG_GUARD)[0]
    assert process.returncode == 0, output


def config_file(tmp_path, port: int, model: str, worker_port: int, extra: str = "") -> str:
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
        wait_until(lambda: _listening(port), "the worker to listen", HANG_GUARD)
        yield process
    finally:
        process.kill()
        process.wait(HANG_GUARD)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_ready(url: str, process: subprocess.Popen) -> None:
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


def test_demo_serves_curl_style_requests_and_the_openai_sdk():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running("demo", "--port", str(port)) as process:
        wait_ready(url, process)
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "furnace-demo", "messages": [{"role": "user", "content": "hi there"}]},
        ).json()
        assert reply["choices"][0]["message"]["content"] == "hi there"

        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = sdk.chat.completions.create(
            model="furnace-demo",
            messages=[{"role": "user", "content": "one two three"}],
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "one two three"

        async def async_sdk() -> str:
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0
            ) as client:
                stream = await client.completions.create(
                    model="furnace-demo", prompt="a b c", stream=True
                )
                return "".join([c.choices[0].text async for c in stream])

        assert asyncio.run(async_sdk()) == "a b c"


def test_worker_and_serve_with_a_config_file(tmp_path):
    worker_port, port = free_port(), free_port()
    config = config_file(tmp_path, port, "echo", worker_port)
    url = f"http://127.0.0.1:{port}"
    with (
        worker_process(worker_port, "--engine", "demo", "--model", "echo"),
        running("serve", "--config", config) as gateway,
    ):
        wait_ready(url, gateway)
        reply = httpx.post(url + "/v1/completions", json={"prompt": "x y"}, timeout=10).json()
        assert reply["model"] == "echo"
        assert reply["choices"][0]["text"] == "x y"


def test_invalid_config_names_the_field(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("max_concurrent_requests: lots\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert result.returncode != 0
    assert "max_concurrent_requests" in result.stderr
    assert "Traceback" not in result.stderr
