"""The commands as a newcomer runs them: real processes, real clients."""

import asyncio
import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.support.processes import (
    config_file,
    free_port,
    listening,
    running,
    wait_ready,
    worker_process,
)
from tests.support.waiting import HANG_GUARD, wait_until


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

        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as sdk:
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
    stderr = _refused("serve", "--config", str(config))
    assert "max_concurrent_requests" in stderr


def test_an_engine_whose_library_is_not_installed_says_where_it_runs(tmp_path):
    """`worker --engine vllm` outside vLLM's environment: a line saying where it runs,
    not an import's traceback."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    port = str(free_port())
    stderr = _refused("worker", "--engine", "vllm", "--model-path", str(tmp_path), "--port", port)
    assert "vLLM's own environment" in stderr


def _refused(*args: str) -> str:
    """`python -m gateway ARGS` that must exit with a line of its own, not a traceback:
    its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, timeout=HANG_GUARD
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    return result.stderr


def _demo_with_output() -> tuple[subprocess.Popen[str], str]:
    """`python -m gateway demo` on a free port, its stdout and stderr on one pipe; its URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "demo", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, f"http://127.0.0.1:{port}"


def test_the_served_gateway_logs_one_access_line_per_request_in_the_log_format():
    process, url = _demo_with_output()
    try:
        wait_ready(url, process)
        ids = []
        for stream in (False, True):
            response = httpx.post(
                url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "a b"}], "stream": stream},
                timeout=HANG_GUARD,
            )
            assert response.status_code == 200
            ids.append(response.headers["x-request-id"])
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=HANG_GUARD)[0]
    assert process.returncode == 0, output
    line = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\w+) ([\w.]+) (.*)")
    lines = [line.fullmatch(text) for text in output.splitlines()]
    assert all(lines), output  # every line in the one format
    access = [json.loads(m[4]) for m in lines if m is not None and m[3] == "furnace.access"]
    assert [(a["request_id"], a["stream"], a["status"]) for a in access] == [
        (ids[0], False, 200),
        (ids[1], True, 200),
    ]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_log_format_json_writes_every_line_as_one_json_object(tmp_path, workers):
    """`log_format: json`, in one process and in several: every line on stderr is a JSON
    object with time, level and logger; an access line's fields are its own."""
    worker_port, port = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"host: 127.0.0.1\nport: {port}\nlog_level: info\nlog_format: json\n"
        f"models:\n  - name: echo\n    workers: ['127.0.0.1:{worker_port}']\n"
    )
    url = f"http://127.0.0.1:{port}"
    written: list[str] = []
    serve = ["serve", "--config", str(config), "--workers", workers]
    with (
        worker_process(worker_port, "--engine", "demo", "--model", "echo"),
        running(*serve, output=written) as gateway,
    ):
        wait_ready(url, gateway)
        response = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert response.status_code == 200
    lines = [json.loads(text) for text in written[0].splitlines()]  # every line is JSON
    stamp = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
    assert lines and all(stamp.fullmatch(line["time"]) and line["level"] for line in lines)
    access = [line for line in lines if line["logger"] == "furnace.access"]
    assert [(a["request_id"], a["route"], a["status"]) for a in access] == [
        (response.headers["x-request-id"], "/v1/completions", 200)
    ]
    assert any("message" in line for line in lines if line["logger"] != "furnace.access")


def test_the_config_and_the_worker_offer_the_same_log_formats():
    from gateway import config, log_setup

    assert tuple(log_setup.FORMATTERS) == config.LOG_FORMATS


def test_a_worker_logs_json_with_log_format_json():
    port = free_port()
    written: list[str] = []
    with running(
        "worker", "--port", str(port), "--host", "127.0.0.1", "--log-format", "json", output=written
    ) as worker:
        wait_until(lambda: listening(port) or worker.poll() is not None, "the worker to listen")
    lines = [json.loads(text) for text in written[0].splitlines()]  # every line is JSON
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)


def test_a_running_gateway_writes_its_lines_while_it_runs_not_only_at_exit():
    # lines are written in batches (gateway/log_setup.py): a request's access line must
    # reach stderr within the batch interval, not wait for the process to end
    process, url = _demo_with_output()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_ready(url, process)
        response = httpx.post(url + "/v1/completions", json={"prompt": "a b"}, timeout=HANG_GUARD)
        request_id = response.headers["x-request-id"]
        wait_until(lambda: any(request_id in line for line in seen), "the access line")
        assert process.poll() is None  # written while it runs
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=HANG_GUARD)
        reader.join(timeout=HANG_GUARD)
        if process.stdout is not None:
            process.stdout.close()
    assert process.returncode == 0, "".join(seen)
