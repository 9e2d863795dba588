"""The fleet with several real workers: kills, hangs, health, DNS, balance,
retry budget and the drain on SIGTERM. Counted, never timed."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import dns.message
import dns.rrset
import httpx

from gateway.config import ModelConfig
from gateway.protocol import errors
from gateway.protocol.types import Event, GenerateRequest
from gateway.worker import Engine
from gateway.worker.demo import DemoEngine
from tests.support.metrics import scrape, value
from tests.support.processes import config_file, free_port, running, wait_ready, worker_process
from tests.support.requests import sse_events
from tests.support.scripted_worker import SCRIPTED_MODEL, ScriptedWorker, script
from tests.support.servers import assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until


def free_port_on(*hosts: str) -> int:
    """A port free on every one of `hosts`."""
    while True:
        port = free_port()
        try:
            for host in hosts:
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return port


def admin_workers(url: str, model: str) -> dict[str, dict]:
    body = httpx.get(url + "/admin/workers", timeout=HANG_GUARD).json()
    pool = next(m for m in body["models"] if m["name"] == model)
    return {w["address"]: w for w in pool["workers"]}


async def stream_text(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None):
    """Streams one completion; returns (text, last payload before [DONE], saw [DONE])."""
    text, last, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if started is not None:
                started.set()
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            payload = sse_events(line)[0]
            last = payload
            if "choices" in payload:
                text += payload["choices"][0]["text"]
    return text, last, done


def test_killed_worker_fails_its_streams_only_and_comes_back(gateway_with):
    ports = [free_port() for _ in range(3)]
    with (
        worker_process(ports[0], "--token-delay", "0.02", "--model", "m") as victim,
        worker_process(ports[1], "--token-delay", "0.02", "--model", "m"),
        worker_process(ports[2], "--token-delay", "0.02", "--model", "m"),
    ):
        addresses = tuple(f"127.0.0.1:{p}" for p in ports)
        gw = gateway_with(
            models=(ModelConfig("m", workers=addresses),), eject_base=0.5, health_check_interval=0.2
        )
        prompt = " ".join(["w"] * 100)  # two seconds of tokens

        async def load() -> list:
            async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
                body = {"prompt": prompt, "stream": True, "max_tokens": 100}
                starts = [asyncio.Event() for _ in range(12)]
                tasks = [asyncio.create_task(stream_text(client, body, s)) for s in starts]
                for started in starts:
                    await started.wait()
                on_victim = admin_workers(gw.url, "m")[addresses[0]]["outstanding"]
                victim.kill()
                results = await asyncio.gather(*tasks)
                return [on_victim, results]

        on_victim, results = asyncio.run(load())
        failed = [r for r in results if r[1] and "error" in r[1]]
        assert all(done for _, _, done in results)  # every stream ends with [DONE]
        assert len(failed) == on_victim > 0
        assert all(r[1]["error"]["code"] == "engine_unavailable" for r in failed)
        assert all(r[0] == prompt for r in results if r not in failed)
        # out of rotation, and new requests succeed on the others
        wait_until(
            lambda: admin_workers(gw.url, "m")[addresses[0]]["state"] != "healthy", "the kill seen"
        )
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
            for _ in range(10):
                response = client.post("/v1/completions", json={"prompt": "a b"})
                assert response.json()["choices"][0]["text"] == "a b"
        # restarted, it is back
        with worker_process(ports[0], "--model", "m"):
            wait_until(
                lambda: admin_workers(gw.url, "m")[addresses[0]]["state"] == "healthy",
                "the restarted worker to be healthy",
                HANG_GUARD,
            )


class HangingEngine(Engine):
    """Accepts calls and never starts them."""

    model = "m"
    max_context = 100

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        await asyncio.sleep(3600)
        yield  # pragma: no cover


class BusyEngine(Engine):
    """Refuses every call: it is full."""

    model = "m"
    max_context = 100

    def __init__(self) -> None:
        self.refusals = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.refusals += 1
        raise errors.Busy("This worker is full.")
        yield  # pragma: no cover


def test_retries_stop_at_retry_attempts_and_count_only_the_tries_that_follow(
    gateway_with, serve_engines
):
    engines = [BusyEngine() for _ in range(3)]
    servers = serve_engines(*engines)
    gw = gateway_with(
        models=(ModelConfig("m", workers=tuple(s.address for s in servers)),),
        retry_attempts=2,
        retry_budget=1.0,
    )
    response = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}, timeout=HANG_GUARD)
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_busy"
    # two tries on two workers; the third worker, free, is not tried past retry_attempts,
    # and the last refusal is no retry: one counted
    assert sorted(engine.refusals for engine in engines) == [0, 1, 1]
    assert gw.state.fleet.models["m"].retries_total == 1


def test_hanging_worker_is_retried_elsewhere_and_ejected_longer_each_time(
    gateway_with, serve_engines
):
    hanging, healthy = serve_engines(HangingEngine(), DemoEngine("m"))
    gw = gateway_with(
        models=(ModelConfig("m", workers=(hanging.address, healthy.address)),),
        start_timeout=0.2,
        eject_after_failures=2,
        eject_base=0.5,
        request_timeout=5,
        retry_budget=1.0,
    )
    worker = gw.state.fleet.models["m"].workers[hanging.address]
    windows = []  # per ejection: the shortest and longest it can be, from when it began
    client = httpx.Client(base_url=gw.url, timeout=HANG_GUARD)
    for streak in (1, 2):
        checked = time.monotonic()
        while worker.ejections_total < streak:
            began_after = checked  # this check found no new ejection
            response = client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == 200  # retried on the healthy worker in time
            checked = time.monotonic()
        wait_until(lambda t=began_after: worker.ejected_until > t, "the ejection's end to be set")
        began_before = time.monotonic()
        assert worker.ejection_streak == streak
        windows.append((worker.ejected_until - began_before, worker.ejected_until - began_after))
        wait_until(lambda: worker.ejected_until <= time.monotonic(), "the ejection to end")
    client.close()
    # eject_base the first time, twice that the second (whatever the machine's speed)
    for (shortest, longest), seconds in zip(windows, (0.5, 1.0), strict=True):
        assert shortest <= seconds <= longest
    assert gw.state.fleet.models["m"].retries_total >= 4


def test_not_serving_worker_leaves_and_returns(gateway_with, serve_engines, server_loop):
    engines = [DemoEngine("m"), DemoEngine("m")]
    a, b = serve_engines(*engines)
    gw = gateway_with(models=(ModelConfig("m", workers=(a.address, b.address)),))
    server_loop.call(a.set_serving(False))
    wait_until(
        lambda: admin_workers(gw.url, "m")[a.address]["state"] == "not_serving", "NOT_SERVING"
    )
    before = engines[0].served
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for _ in range(20):
            client.post("/v1/completions", json={"prompt": "x"})
        assert engines[0].served == before
        server_loop.call(a.set_serving(True))
        wait_until(lambda: admin_workers(gw.url, "m")[a.address]["state"] == "healthy", "SERVING")
        for _ in range(20):
            client.post("/v1/completions", json={"prompt": "x"})
    assert engines[0].served > before


def test_a_model_served_only_by_a_worker_of_another_model_keeps_following_it(
    gateway_with, serve_engines, server_loop
):
    """The worker is described again every health interval (its load): a worker of
    another model is said wrong once and stays out, and its follow-up goes on (it
    raised a KeyError, and the task that follows the worker's load died)."""
    (wrong,) = serve_engines(DemoEngine("other"))
    gw = gateway_with(
        models=(ModelConfig("m", workers=(wrong.address,)),), health_check_interval=0.1
    )
    wait_until(lambda: admin_workers(gw.url, "m")[wrong.address]["state"] == "wrong_model", "out")
    fleet = gw.state.fleet
    pool = fleet.models["m"]
    worker = pool.workers[wrong.address]
    for _ in range(2):  # as the follow-up describes it: quietly, again and again
        assert server_loop.call(fleet._describe(pool, worker, quiet=True))
    assert worker.misfit == "wrong_model" and pool.max_context is None
    response = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}, timeout=HANG_GUARD)
    assert response.status_code == 503


def test_no_healthy_worker_is_503_at_once(gateway_with, serve_engines, server_loop):
    (a,) = serve_engines(DemoEngine("m"))
    gw = gateway_with(models=(ModelConfig("m", workers=(a.address,)),))
    server_loop.call(a.set_serving(False))
    wait_until(
        lambda: admin_workers(gw.url, "m")[a.address]["state"] == "not_serving", "NOT_SERVING"
    )
    for stream in (False, True):
        response = httpx.post(
            gw.url + "/v1/completions", json={"prompt": "x", "stream": stream}, timeout=30
        )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "engine_unavailable"


def test_worker_of_another_model_is_kept_out(gateway_with, serve_engines):
    right, wrong = serve_engines(DemoEngine("m"), DemoEngine("other"))
    gw = gateway_with(models=(ModelConfig("m", workers=(right.address, wrong.address)),))
    assert admin_workers(gw.url, "m")[wrong.address]["state"] == "wrong_model"
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for _ in range(10):
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


class DnsServer(asyncio.DatagramProtocol):
    """A name server on loopback whose A records the test sets."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        query = dns.message.from_wire(data)
        reply = dns.message.make_response(query)
        name = query.question[0].name.to_text()
        ips = self.records.get(name, [])
        if ips:
            reply.answer.append(dns.rrset.from_text_list(name, 1, "IN", "A", ips))
        else:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        assert self.transport is not None
        self.transport.sendto(reply.to_wire(), addr)


@contextmanager
def serving_dns(server_loop) -> Iterator[tuple[DnsServer, int]]:
    """A `DnsServer` on the server loop, and its port, closed after."""
    dns_server = DnsServer()

    async def start() -> asyncio.DatagramTransport:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: dns_server, local_addr=("127.0.0.1", 0)
        )
        return transport

    transport = server_loop.call(start())
    try:
        yield dns_server, transport.get_extra_info("sockname")[1]
    finally:
        server_loop.loop.call_soon_threadsafe(transport.close)


def test_dns_answers_add_and_remove_workers(gateway_with, serve_engines, server_loop):
    port = free_port_on("127.0.0.2", "127.0.0.3")
    serve_engines(DemoEngine("m"), host="127.0.0.2", port=port)
    serve_engines(DemoEngine("m"), host="127.0.0.3", port=port)
    with serving_dns(server_loop) as (dns_server, dns_port):
        dns_server.records["workers.test."] = ["127.0.0.2"]
        entry = f"dns://127.0.0.1:{dns_port}/workers.test:{port}"
        gw = gateway_with(models=(ModelConfig("m", workers=(entry,)),), discovery_interval=0.05)

        def members() -> set[str]:
            return {a for a, w in admin_workers(gw.url, "m").items() if w["state"] == "healthy"}

        assert members() == {f"127.0.0.2:{port}"}
        dns_server.records["workers.test."] = ["127.0.0.2", "127.0.0.3"]
        wait_until(lambda: members() == {f"127.0.0.2:{port}", f"127.0.0.3:{port}"}, "a join")
        dns_server.records["workers.test."] = ["127.0.0.3"]
        wait_until(lambda: set(admin_workers(gw.url, "m")) == {f"127.0.0.3:{port}"}, "a leave")
        response = httpx.post(gw.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert response.status_code == 200


def test_a_model_whose_workers_all_left_counts_none_healthy(
    gateway_with, serve_engines, server_loop
):
    """Once DNS names no worker, a model has no per-worker series left: the per-model
    gauge still says 0, for the no-healthy-worker alert to fire on."""
    port = free_port_on("127.0.0.2")
    serve_engines(DemoEngine("m"), host="127.0.0.2", port=port)
    with serving_dns(server_loop) as (dns_server, dns_port):
        dns_server.records["workers.test."] = ["127.0.0.2"]
        entry = f"dns://127.0.0.1:{dns_port}/workers.test:{port}"
        gw = gateway_with(models=(ModelConfig("m", workers=(entry,)),), discovery_interval=0.05)
        healthy = "furnace_gateway_model_healthy_workers"
        assert value(scrape(gw.url), healthy, model="m") == 1
        dns_server.records["workers.test."] = []
        wait_until(lambda: admin_workers(gw.url, "m") == {}, "the worker to leave")
        samples = scrape(gw.url)
        assert not [key for key in samples if key[0] == "furnace_gateway_worker_healthy"]
        assert (healthy, (("model", "m"),)) in samples
        assert value(samples, healthy, model="m") == 0


def test_equal_workers_get_equal_shares(gateway_with, serve_engines):
    engines = [DemoEngine("m") for _ in range(3)]
    servers = serve_engines(*engines)
    gw = gateway_with(models=(ModelConfig("m", workers=tuple(s.address for s in servers)),))

    async def load() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
            for _ in range(10):
                await asyncio.gather(
                    *(client.post("/v1/completions", json={"prompt": "x"}) for _ in range(30))
                )

    asyncio.run(load())
    shares = [e.served for e in engines]
    assert sum(shares) == 300
    assert all(70 <= s <= 130 for s in shares), shares


def test_prefix_affinity_keeps_a_prefix_on_one_worker_within_the_load_bound(
    gateway_with, serve_engines
):
    engines = [DemoEngine("m", token_delay=0.02) for _ in range(3)]
    servers = serve_engines(*engines)
    gw = gateway_with(
        models=(
            ModelConfig("m", workers=tuple(s.address for s in servers), balance="prefix_affinity"),
        ),
        affinity_load_factor=1.25,
    )
    shared = "You are a helpful assistant. " * 20
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for i in range(10):
            client.post("/v1/completions", json={"prompt": f"{shared}{i}", "max_tokens": 1})
    assert sorted(e.served for e in engines) == [0, 0, 10]  # one worker took them all

    async def burst() -> int:
        async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
            body = {"prompt": shared + "w " * 30, "max_tokens": 25, "stream": True}
            starts = [asyncio.Event() for _ in range(12)]
            tasks = [asyncio.create_task(stream_text(client, body, s)) for s in starts]
            for started in starts:
                await started.wait()
            busiest = max(w["outstanding"] for w in admin_workers(gw.url, "m").values())
            await asyncio.gather(*tasks)
            return busiest

    assert asyncio.run(burst()) <= 5  # ceil(1.25 * 12 / 3)


def test_retry_budget_holds_when_every_worker_fails(gateway_with, server_loop):
    failing = [ScriptedWorker() for _ in range(3)]
    for worker in failing:
        server_loop.call(worker.start())
    try:
        gw = gateway_with(
            models=(ModelConfig(SCRIPTED_MODEL, workers=tuple(w.address for w in failing)),),
            retry_budget=0.2,
            retry_backoff=0,
        )
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
            for _ in range(100):
                response = client.post(
                    "/v1/completions", json={"prompt": script(status="UNAVAILABLE")}
                )
                assert response.status_code == 503
        calls = sum(len(w.calls) for w in failing)
        assert 100 < calls <= 100 + 0.2 * 100 + 3
    finally:
        for worker in failing:
            server_loop.call(worker.stop())


def test_sigterm_lets_50_streams_finish_refuses_new_ones_and_exits_0(tmp_path):
    worker_port, port = free_port(), free_port()
    config = config_file(tmp_path, port, "m", worker_port, "drain_timeout: 20\n")
    url = f"http://127.0.0.1:{port}"
    with (
        worker_process(worker_port, "--token-delay", "0.05", "--model", "m"),
        running("serve", "--config", config) as gateway,
    ):
        wait_ready(url, gateway)

        async def scenario() -> tuple[list, list[int]]:
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD, limits=limits) as client:
                # 100 tokens at 0.05 s: a drain of about 5 s, so the checks below see it
                # running even when this process's loop is slow on a loaded machine (at 30
                # tokens it once ended first: the gateway's listener was closed, ConnectError)
                body = {"prompt": "w " * 100, "stream": True}
                starts = [asyncio.Event() for _ in range(50)]
                tasks = [asyncio.create_task(stream_text(client, body, s)) for s in starts]
                for started in starts:
                    await started.wait()
                gateway.send_signal(signal.SIGTERM)
                async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD) as fresh:
                    # the drain has begun when /ready says so (another process: polled)
                    async with asyncio.timeout(HANG_GUARD):
                        while (await fresh.get("/ready")).status_code != 503:  # noqa: ASYNC110
                            await asyncio.sleep(0.01)
                    statuses = [
                        (await fresh.get("/health")).status_code,
                        (await fresh.post("/v1/completions", json={"prompt": "x"})).status_code,
                    ]
                return list(await asyncio.gather(*tasks)), statuses

        results, statuses = asyncio.run(scenario())
        assert statuses == [200, 503]
        assert len(results) == 50
        for text, last, done in results:
            assert done and text == "w " * 99 + "w"
            assert last["choices"][0]["finish_reason"] == "stop"
        assert gateway.wait(HANG_GUARD) == 0


def test_drain_timeout_cancels_the_rest(gateway_with, serve_engines, server_loop):
    engine = DemoEngine("m", token_delay=0.05)
    (server,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig("m", workers=(server.address,)),))

    async def scenario() -> list:
        async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
            starts = [asyncio.Event() for _ in range(5)]
            body = {"prompt": "w " * 200, "stream": True}
            tasks = [asyncio.create_task(stream_text(client, body, s)) for s in starts]
            for started in starts:
                await started.wait()
            asyncio.run_coroutine_threadsafe(gw.state.inflight.drain(0.2), server_loop.loop)
            return list(await asyncio.gather(*tasks))

    aborted = engine.aborted
    results = asyncio.run(scenario())
    assert all(done and last["error"]["code"] == "gateway_shutdown" for _, last, done in results)
    wait_until(lambda: engine.aborted == aborted + 5, "the worker to see the cancellations")
    assert_nothing_left(gw, None)
    assert httpx.get(gw.url + "/ready").status_code == 503
