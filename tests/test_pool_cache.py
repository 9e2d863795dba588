"""The pool keeps who is available between changes (`ModelPool.available`, a `Roster`):
every change of a worker is seen at the next pick, against the real gateway and real
gRPC workers: an ejection and its end (with nothing else changing), health going and
coming back, workers joining and leaving through discovery, a full worker's room."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx

from gateway.config import ModelConfig
from gateway.protocol import errors
from gateway.protocol.types import Event, GenerateRequest
from gateway.worker.demo import DemoEngine
from tests.support.waiting import HANG_GUARD, until, wait_until
from tests.test_fleet import admin_workers, free_port_on, serving_dns


class FailingFirst(DemoEngine):
    """Fails its first `failures` requests as a broken engine (a transport failure for
    the gateway), then serves as the demo engine."""

    def __init__(self, failures: int) -> None:
        super().__init__("m")
        self.failures = failures

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if self.failures > 0:
            self.failures -= 1
            raise errors.Failed("The engine broke.")
        async for event in super().generate(request):
            yield event


def test_an_ejection_is_seen_at_the_next_pick_and_its_end_with_nothing_else_changing(
    gateway_with, serve_engines
):
    engine = FailingFirst(failures=1)
    (server,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("m", workers=(server.address,)),), eject_after_failures=1, eject_base=3
    )
    worker = gw.state.fleet.models["m"].workers[server.address]
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code >= 500
        assert worker.ejections_total == 1
        response = client.post("/v1/completions", json={"prompt": "x"})
        if time.monotonic() < worker.ejected_until:  # (else the machine took 3 s to answer)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_unavailable"
            assert engine.served == 0
        # the ejection ends on its own: no health change, no discovery, no other call
        wait_until(lambda: time.monotonic() >= worker.ejected_until, "the ejection's end")
        assert worker.serving is True and worker.state == "healthy"
        response = client.post("/v1/completions", json={"prompt": "x"})
        assert response.status_code == 200, response.text
    assert engine.served >= 1


def test_health_going_and_coming_back_is_seen_at_the_next_pick(
    gateway_with, serve_engines, server_loop
):
    engine = DemoEngine("m")
    (server,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig("m", workers=(server.address,)),))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        for serving, state, status in ((False, "not_serving", 503), (True, "healthy", 200)):
            server_loop.call(server.set_serving(serving))
            wait_until(
                lambda s=state: admin_workers(gw.url, "m")[server.address]["state"] == s, state
            )
            response = client.post("/v1/completions", json={"prompt": "x"})
            assert response.status_code == status, response.text
    assert engine.served == 2


def test_workers_joining_leaving_and_coming_back_are_seen_at_the_next_pick(
    gateway_with, serve_engines, server_loop
):
    port = free_port_on("127.0.0.2", "127.0.0.3")
    a, b = DemoEngine("m"), DemoEngine("m")
    serve_engines(a, host="127.0.0.2", port=port)
    serve_engines(b, host="127.0.0.3", port=port)
    ips = {a: "127.0.0.2", b: "127.0.0.3"}
    with serving_dns(server_loop) as (dns_server, dns_port):
        dns_server.records["workers.test."] = [ips[a]]
        entry = f"dns://127.0.0.1:{dns_port}/workers.test:{port}"
        gw = gateway_with(models=(ModelConfig("m", workers=(entry,)),), discovery_interval=0.05)
        client = httpx.Client(base_url=gw.url, timeout=HANG_GUARD)

        def move_to(engine: DemoEngine) -> None:
            """The name resolves to both, then to `engine` only: the other leaves."""
            address = f"{ips[engine]}:{port}"
            dns_server.records["workers.test."] = [ips[a], ips[b]]
            wait_until(lambda: address in admin_workers(gw.url, "m"), "a join")
            dns_server.records["workers.test."] = [ips[engine]]
            wait_until(lambda: set(admin_workers(gw.url, "m")) == {address}, "a leave")
            before = engine.served
            for _ in range(5):
                assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
            assert engine.served == before + 5

        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert (a.served, b.served) == (1, 0)
        move_to(b)  # b joins, a leaves
        move_to(a)  # a comes back, b leaves
        assert (a.served, b.served) == (6, 5)
        client.close()


def test_saturation_follows_each_workers_room(gateway_with, serve_engines):
    engines = [DemoEngine("m", token_delay=0.05, capacity=1) for _ in range(2)]
    servers = serve_engines(*engines)
    gw = gateway_with(models=(ModelConfig("m", workers=tuple(s.address for s in servers)),))
    pool = gw.state.fleet.models["m"]
    wait_until(lambda: all(w.capacity == 1 for w in pool.workers.values()), "the capacities")
    long = {"prompt": " ".join(["w"] * 40), "max_tokens": 40}  # two seconds of tokens

    async def load() -> list[int]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=HANG_GUARD) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=long))
            await until(lambda: sum(e.running for e in engines) == 1, "the first call")
            # one worker full: the other has room
            second = asyncio.create_task(client.post("/v1/completions", json=long))
            await until(lambda: sum(e.running for e in engines) == 2, "the second call")
            both_full = await client.post("/v1/completions", json={"prompt": "x"})
            error = both_full.json()["error"]
            # refused by the gateway (`saturated`), not tried on the full workers
            codes = [both_full.status_code, error["code"], "as it says it can" in error["message"]]
            (await first).raise_for_status()
            # a worker has room again
            freed = await client.post("/v1/completions", json={"prompt": "x"})
            (await second).raise_for_status()
            return [*codes, freed.status_code]

    assert asyncio.run(load()) == [503, "server_busy", True, 200]
    assert [e.served for e in engines] in ([2, 1], [1, 2])
    wait_until(lambda: all(w.outstanding == 0 for w in pool.workers.values()), "the calls' ends")
    assert pool.available(set()).outstanding == 0  # the roster counted each start and end
