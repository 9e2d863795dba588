"""Several gateway processes on one port (`serve --workers N`): a real gateway of two
processes serves requests from both, splits its slots, answers one admin listener
with every process's metrics, drains every process on SIGTERM, and stops whole
when one of its processes dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, parse_config
from gateway.lifecycle.processes import check_split, process_config, share
from gateway.telemetry.merge import merge_expositions
from tests.support.processes import free_port, listening, worker_process
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "furnace-demo"


def test_shares_add_up_to_the_total() -> None:
    for total in (1, 7, 256):
        for count in range(1, 5):
            assert sum(share(total, count, i) for i in range(count)) == total


def test_each_process_gets_its_share_of_slots_connections_and_local_team_limits() -> None:
    config = parse_config(
        {
            "max_concurrent_requests": 9,
            "max_connections": 100,
            "admin_port": 9090,
            "teams": {
                "search": {
                    "max_concurrent_requests": 5,
                    "requests_per_minute": 60,
                    "budgets": [{"window": "day", "tokens": 1001, "spend": 3.0}],
                }
            },
        }
    )
    parts = [process_config(config, 2, i) for i in range(2)]
    # without Redis each process counts alone, so each holds its share of a budget
    # (a reloaded config file gets the same share: GatewayServer's `share`)
    assert [p.teams[0].budgets[0].tokens for p in parts] == [501, 500]
    assert [p.teams[0].budgets[0].spend for p in parts] == [1.5, 1.5]
    assert [p.max_concurrent_requests for p in parts] == [5, 4]
    assert [p.max_connections for p in parts] == [50, 50]
    assert [p.teams[0].max_concurrent_requests for p in parts] == [3, 2]
    assert [p.teams[0].requests_per_minute for p in parts] == [30, 30]
    assert all(p.admin_port == 0 and p.admin_host == "127.0.0.1" for p in parts)


def test_with_redis_team_limits_stay_whole_in_every_process() -> None:
    config = parse_config(
        {"redis_url": "redis://127.0.0.1:1", "teams": {"search": {"max_concurrent_requests": 1}}}
    )
    check_split(config, 4)  # Redis holds the limit: exact across processes
    assert process_config(config, 4, 3).teams[0].max_concurrent_requests == 1
    budgeted = parse_config(
        {
            "redis_url": "redis://127.0.0.1:1",
            "teams": {"s": {"budgets": [{"window": "month", "tokens": 9}]}},
        }
    )
    assert process_config(budgeted, 4, 3).teams[0].budgets[0].tokens == 9


def test_a_limit_smaller_than_the_processes_is_refused_without_redis() -> None:
    with pytest.raises(ConfigError, match=r"teams\.search\.max_concurrent_requests"):
        check_split(parse_config({"teams": {"search": {"max_concurrent_requests": 1}}}), 2)
    with pytest.raises(ConfigError, match="max_concurrent_requests"):
        check_split(parse_config({"max_concurrent_requests": 2}), 3)


def test_merged_metrics_name_each_process_and_keep_each_family_once() -> None:
    texts = []
    for served in (1, 5):
        registry = CollectorRegistry()
        requests = Counter("furnace_gateway_requests", "R.", ["model"], registry=registry)
        requests.labels(MODEL).inc(served)
        Gauge("furnace_gateway_slots", "S.", ["state"], registry=registry).labels("total").set(4)
        texts.append(generate_latest(registry).decode())
    merged = merge_expositions([*texts, None]).decode()  # a third process did not answer
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = {
        (s.name, s.labels["process"]): s.value for s in families["furnace_gateway_requests"].samples
    }
    assert samples == {
        ("furnace_gateway_requests_total", "0"): 1.0,
        ("furnace_gateway_requests_total", "1"): 5.0,
    }
    assert merged.count("# TYPE furnace_gateway_slots gauge") == 1


def _serve(tmp_path: Path, port: int, worker_port: int, extra: str, processes: int) -> list[str]:
    """The command serving MODEL from one worker on `port` as `processes` processes, its
    config written (`extra`: more of its lines)."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"host: 127.0.0.1\nport: {port}\n{extra}"
        f"models:\n  - name: {MODEL}\n    workers: ['127.0.0.1:{worker_port}']\n"
    )
    serve = ["serve", "--config", str(config), "--workers", str(processes)]
    return [sys.executable, "-m", "gateway", *serve]


@contextmanager
def gateway_processes(
    tmp_path: Path, worker_port: int, extra: str = ""
) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """`serve --workers 2` with an admin port, until the block ends (then killed if alive)."""
    port, admin = free_port(), free_port()
    extra = f"admin_port: {admin}\nlog_level: warning\n{extra}"
    command = _serve(tmp_path, port, worker_port, extra, processes=2)
    process = subprocess.Popen(  # a session of its own, as a terminal's job: its group
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_until(lambda: _ready(admin, process), "both processes to be ready", 2 * HANG_GUARD)
        yield process, port, admin
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=HANG_GUARD)


def _ready(admin: int, process: subprocess.Popen[str]) -> bool:
    assert process.poll() is None, process.communicate()[0]
    try:
        return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _chat(port: int, words: int = 3, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(["w"] * words)}]}
    with httpx.Client(timeout=HANG_GUARD) as client:  # a new connection each time
        return client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)


def _metric(admin: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=HANG_GUARD).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["SIGTERM to the gateway", "Ctrl-C"])
def test_two_processes_share_the_port_and_the_slots_and_drain_on_a_signal(
    tmp_path: Path, ctrl_c: bool
) -> None:
    worker_port = free_port()
    with (
        worker_process(worker_port, "--token-delay", "0.05"),
        gateway_processes(tmp_path, worker_port, "max_concurrent_requests: 7\n") as (
            gateway,
            port,
            admin,
        ),
    ):
        # Connections spread over both processes (20 new ones: all on one, 2^-19).
        assert all(_chat(port).status_code == 200 for _ in range(20))
        served = _metric(admin, "furnace_gateway_requests_total")
        assert {dict(labels)["process"] for labels in served} == {"0", "1"}
        assert sum(served.values()) == 20
        slots = _metric(admin, "furnace_gateway_slots")
        totals = {dict(k)["process"]: v for k, v in slots.items() if ("state", "total") in k}
        assert totals == {"0": 4.0, "1": 3.0}
        workers = httpx.get(f"http://127.0.0.1:{admin}/admin/workers", timeout=HANG_GUARD)
        assert [p["process"] for p in workers.json()["processes"]] == [0, 1]

        # A stream in flight when SIGTERM comes finishes whole; then every process exits.
        answers: list[httpx.Response] = []
        streaming = threading.Thread(target=lambda: answers.append(_chat(port, words=30)))
        streaming.start()
        wait_until(
            lambda: sum(_metric(admin, "furnace_gateway_inflight_requests").values()) == 1,
            "the stream to start",
        )
        if ctrl_c:  # SIGINT to the whole group, as a terminal sends it
            os.killpg(gateway.pid, signal.SIGINT)
        else:
            gateway.send_signal(signal.SIGTERM)
        streaming.join(HANG_GUARD)
        assert answers[0].status_code == 200
        assert answers[0].json()["choices"][0]["message"]["content"] == " ".join(["w"] * 30)
        assert gateway.wait(HANG_GUARD) == 0
        assert not listening(port)
        assert not listening(admin)


def test_a_signal_while_the_processes_start_stops_them_once_they_are_up(tmp_path: Path) -> None:
    """SIGTERM as soon as the first of four processes serves (the others still starting):
    the gateway takes it once they are up and exits 0, rather than dying of it."""
    worker_port, port = free_port(), free_port()
    command = _serve(tmp_path, port, worker_port, "log_level: info\n", processes=4)
    with worker_process(worker_port):
        gateway = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_until(lambda: listening(port) or gateway.poll() is not None, "the first process")
            gateway.send_signal(signal.SIGTERM)
            output = gateway.communicate(timeout=2 * HANG_GUARD)[0]
        finally:
            if gateway.poll() is None:
                gateway.kill()
    assert gateway.returncode == 0, output
    assert "stopping: every process drains" in output
    assert not listening(port)


def test_every_process_reads_the_config_file_again_when_it_changes(tmp_path: Path) -> None:
    worker_port = free_port()
    with (
        worker_process(worker_port),
        gateway_processes(tmp_path, worker_port) as (_, port, admin),
    ):
        assert _chat(port, model="chat").status_code == 404
        config = tmp_path / "config.yaml"
        draft = tmp_path / "config.new"
        draft.write_text(config.read_text() + f"aliases:\n  chat: [{{model: {MODEL}}}]\n")
        os.replace(draft, config)  # a new file at once, as a ConfigMap's volume swaps it
        # each process looks every 10 s; 20 new connections reach both (all on one: 2^-19)
        wait_until(
            lambda: all(_chat(port, model="chat").status_code == 200 for _ in range(20)),
            "both processes to serve the new alias",
            2 * HANG_GUARD,
        )
        routed = _metric(admin, "furnace_gateway_routed_requests_total")
        assert {dict(labels)["process"] for labels in routed} == {"0", "1"}
        assert {dict(labels)["asked"] for labels in routed} == {"chat"}


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            found += [int(p) for p in listed.read().split()]
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_process_that_dies_stops_the_others_and_the_gateway_exits_1(tmp_path: Path) -> None:
    worker_port = free_port()
    with (
        worker_process(worker_port),
        gateway_processes(tmp_path, worker_port) as (gateway, port, _),
    ):
        spawned = [p for p in _children(gateway.pid) if _is_gateway_process(p)]
        assert len(spawned) == 2
        os.kill(spawned[0], signal.SIGKILL)
        assert gateway.wait(HANG_GUARD) == 1
        end = time.monotonic() + HANG_GUARD
        while os.path.exists(f"/proc/{spawned[1]}") and time.monotonic() < end:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{spawned[1]}")
        assert not listening(port)


def _is_gateway_process(pid: int) -> bool:
    """One of the spawned gateway processes (not multiprocessing's resource tracker)."""
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return b"multiprocessing.spawn" in cmdline.read()
