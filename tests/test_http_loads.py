"""Load records of `upstream: openai` workers, read from their Prometheus `/metrics`
(`gateway.upstreams.openai_http.loads`, `kv_follow.follow_loads`): a real gateway under
uvicorn in front of real OpenAI-compatible servers (tests/support/openai_server.py, whose
`/metrics` says what the test sets, in vLLM's names), and real vLLM's HTTP server for
the names themselves. A worker whose engine queues past `max_engine_waiting` is routed
around, and the model sheds once every worker is; a server without the gauges keeps no
load record, visibly, and serves on. The gateway asks vLLM for those gauges alone
(`LOAD_QUERY`)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.fleet.routing import Router
from gateway.protocol.kv_blocks import EngineLoad
from gateway.upstreams.openai_http.loads import LOAD_QUERY, engine_load, engine_ranks
from gateway.upstreams.openai_http.polls import FRESH, SharedPolls
from tests.support.certs import CertificateAuthority
from tests.support.openai_server import OpenAIServer
from tests.support.servers import Gateway, ServerLoop, worker_states
from tests.support.vllm import VllmProcess
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "http-loads"
KEY_ENV = "FURNACE_TEST_HTTP_LOADS_KEY"


@pytest.fixture
def servers(
    server_loop: ServerLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[OpenAIServer], CertificateAuthority]]:
    """Two fake OpenAI servers sharing one key, each answering its own name."""
    ca = CertificateAuthority(tmp_path, "upstream-ca")
    key = "sk-" + secrets.token_hex(8)
    started = [
        OpenAIServer(MODEL, key, ca.issue(name, ips=("127.0.0.1",)), reply=name)
        for name in ("first", "second")
    ]
    monkeypatch.setenv(KEY_ENV, key)
    for server in started:
        server_loop.call(server.start())
    yield started, ca
    for server in started:
        server_loop.call(server.stop())


def _model(servers: list[OpenAIServer], ca: CertificateAuthority, **fields: Any) -> ModelConfig:
    """The model of `servers`, reached with their key and CA, with `fields`."""
    workers = tuple(s.url for s in servers)
    return ModelConfig(
        MODEL, workers=workers, upstream="openai", api_key_env=KEY_ENV, ca_file=ca.ca_file, **fields
    )


def _gateway(
    gateway_with: Callable[..., Gateway],
    servers: list[OpenAIServer],
    ca: CertificateAuthority,
    **routing: object,
) -> tuple[Gateway, Router]:
    model = _model(servers, ca, routing=RoutingConfig(load_interval=0.1, **routing))  # type: ignore[arg-type]
    gw = gateway_with(models=(model,))
    router = gw.state.fleet.models[MODEL].router
    assert router is not None
    return gw, router


def _chat(gw: Gateway) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)


def _served_by(gw: Gateway) -> str:
    response = _chat(gw)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_a_worker_whose_engine_queues_past_the_bound_is_routed_around_then_shed(
    servers: tuple[list[OpenAIServer], CertificateAuthority],
    gateway_with: Callable[..., Gateway],
) -> None:
    (first, second), ca = servers
    first.load = second.load = (1, 0, 0.25)
    gw, router = _gateway(gateway_with, [first, second], ca, max_engine_waiting=2)

    def load(server: OpenAIServer) -> EngineLoad | None:
        kv = router.index.workers.get(server.url)
        return None if kv is None else kv.load

    wait_until(lambda: load(first) is not None and load(second) is not None, "both loads")
    assert load(first) == EngineLoad(running=1, waiting=0, kv_usage=0.25)
    assert router.scrapes == {first.url: "loads", second.url: "loads"}
    # these servers do not filter at /metrics/ (a redirect): their whole page is read
    upstream = gw.state.fleet.models[MODEL].workers[first.url].upstream
    assert getattr(upstream, "metrics_url", None) == first.url.removesuffix("/v1") + "/metrics"

    first.load = (3, 5, 0.5)  # 5 waiting: past max_engine_waiting
    wait_until(lambda: router.engine_full(first.url), "the first engine's queue in its record")
    assert load(first) == EngineLoad(running=3, waiting=5, kv_usage=0.5)
    assert {_served_by(gw) for _ in range(6)} == {"second"}

    second.load = (0, 3, 0.1)
    wait_until(lambda: router.engine_full(second.url), "the second engine's queue")
    shed = _chat(gw)
    assert shed.status_code == 503, shed.text
    assert shed.json()["error"]["code"] == "server_busy"
    metrics = httpx.get(gw.url + "/metrics", timeout=HANG_GUARD).text
    assert f'model="{MODEL}",reason="workers_saturated"' in metrics
    workers = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()
    (model,) = [m for m in workers["models"] if m["name"] == MODEL]
    assert all(w["routing"]["engine_full"] for w in model["workers"])
    assert all(w["routing"]["load_scrape"] == "loads" for w in model["workers"])

    first.load = (0, 0, 0.0)  # its queue drained: it takes requests again
    wait_until(lambda: not router.engine_full(first.url), "the first engine's room")
    assert _served_by(gw) == "first"

    second.metrics_status = 500  # a failing read drops the record: not full by it
    wait_until(lambda: router.scrapes[second.url] == "broken", "the failed read")
    assert load(second) is None and not router.engine_full(second.url)
    second.metrics_status = 200
    wait_until(lambda: router.scrapes[second.url] == "loads", "the next read")
    assert router.engine_full(second.url)


def test_a_server_without_vllm_gauges_keeps_no_load_record_visibly_and_serves(
    servers: tuple[list[OpenAIServer], CertificateAuthority],
    gateway_with: Callable[..., Gateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    (server, _), ca = servers  # its load is None: /metrics answers 404
    caplog.set_level(logging.INFO, logger="furnace.fleet.kv")
    gw, router = _gateway(gateway_with, [server], ca, policy="least_load", max_kv_usage=0.5)
    wait_until(lambda: router.scrapes.get(server.url) == "unsupported", "the first read")
    assert server.url not in router.index.workers
    for _ in range(3):
        assert _served_by(gw) == "first"  # never an error per request, never shed
    assert router.last.reason == "fallback"  # least_load without a record: p2c
    workers = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()
    (model,) = [m for m in workers["models"] if m["name"] == MODEL]
    (worker,) = model["workers"]
    assert worker["routing"]["load_scrape"] == "unsupported"
    assert worker["routing"]["load"] is None
    metrics = httpx.get(gw.url + "/metrics", timeout=HANG_GUARD).text
    state = f'load_scrape{{model="{MODEL}",state="unsupported",worker="{server.url}"}} 1.0'
    assert state in metrics
    said = [r for r in caplog.records if "no vLLM load gauges" in r.getMessage()]
    assert len(said) == 1


def test_a_servers_own_slice_of_the_ranks_is_what_its_engines_are_followed_by(
    servers: tuple[list[OpenAIServer], CertificateAuthority],
    gateway_with: Callable[..., Gateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under vLLM's hybrid load balancing a server runs ranks 8 and 9 of a larger group:
    given two engines, `#dp0` and `#dp1` are pinned by their index among its own (as vLLM
    pins: `X-data-parallel-rank` 0 and 1) and read by their ranks (the samples of
    `engine="8"` and `"9"`). Given three, the third is one it does not run: kept out
    (`no_such_engine`), saying its ranks. Under external load balancing a server runs one
    rank (here 5) and is one worker: nothing to say, it serves."""
    (hybrid, external), ca = servers
    hybrid.load, external.load = (3, 0, 0.5), (0, 0, 0.0)
    hybrid.engines, external.engines = (8, 9), (5,)
    routing = RoutingConfig(policy="least_load", load_interval=0.1)
    split = _model([hybrid], ca, data_parallel_size=2, routing=routing)
    alone = replace(_model([external], ca), name="http-loads-alone")
    external.model = alone.name
    gw = gateway_with(models=(split, alone))
    engines = [f"{hybrid.url}#dp{index}" for index in range(2)]
    wait_until(
        lambda: worker_states(gw, MODEL) == dict.fromkeys(engines, "healthy"), "both serving"
    )
    router = gw.router(MODEL)

    def loads() -> list[EngineLoad | None]:
        return [getattr(router.index.workers.get(e), "load", None) for e in engines]

    wait_until(lambda: None not in loads(), "each engine's load record")
    # rank 8 (the page's first) runs two and its cache is half full; rank 9 runs one
    assert loads() == [EngineLoad(running=2, kv_usage=0.5), EngineLoad(running=1)]
    assert _served_by(gw) == "first"
    assert hybrid.last_rank == "1"  # the less loaded: rank 9, pinned as its server's second
    workers = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()
    (view,) = [m for m in workers["models"] if m["name"] == MODEL]
    assert [w["engine_rank"] for w in view["workers"]] == [8, 9]
    assert not [r for r in caplog.records if r.name == "furnace.fleet" and r.levelno >= 30]

    wait_until(lambda: worker_states(gw, alone.name) == {external.url: "healthy"}, "serving")
    body = {"model": alone.name, "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    assert external.last_rank is None
    assert not [r for r in caplog.records if external.url in r.getMessage()]

    three = gateway_with(models=(replace(split, data_parallel_size=3),))
    out = {**dict.fromkeys(engines, "healthy"), f"{hybrid.url}#dp2": "no_such_engine"}
    wait_until(lambda: worker_states(three, MODEL) == out, "the third engine kept out")
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "furnace.fleet")
    assert "its server runs 2 data-parallel engines (ranks 8, 9), not 3" in said


def test_the_engines_of_a_data_parallel_server_poll_it_as_one(
    servers: tuple[list[OpenAIServer], CertificateAuthority],
    gateway_with: Callable[..., Gateway],
) -> None:
    """Four engines of one server (`data_parallel_size: 4`), each a worker, share their
    polls of it (`openai_http.polls`): its `/health`, `/v1/models` and `/metrics` are each
    asked about once an interval, not once an engine; each engine still has its own
    load record, read from its own samples of the page, and serves."""
    (server, _), ca = servers
    server.engines, server.load = (0, 1, 2, 3), (4, 0, 0.25)
    interval = 0.2
    routing = RoutingConfig(policy="least_load", load_interval=interval)
    model = _model([server], ca, data_parallel_size=4, routing=routing)
    gw = gateway_with(models=(model,), health_check_interval=interval)
    router = gw.state.fleet.models[MODEL].router
    assert router is not None
    engines = [f"{server.url}#dp{rank}" for rank in range(4)]

    def loads() -> list[EngineLoad | None]:
        return [getattr(router.index.workers.get(e), "load", None) for e in engines]

    wait_until(lambda: None not in loads(), "each engine's load record")
    first = EngineLoad(running=2, waiting=0, kv_usage=0.25)  # the page's first engine's
    assert loads() == [first, EngineLoad(running=2), EngineLoad(), EngineLoad()]
    wait_until(lambda: set(worker_states(gw, MODEL).values()) == {"healthy"}, "all serving")
    server.gets.clear()
    began = time.monotonic()
    time.sleep(10 * interval)
    rounds = (time.monotonic() - began) / interval + 1
    # one GET a round: of four engines unshared, four (the /metrics page twice a round:
    # each engine's load and its describe)
    assert 0 < server.gets["/health"] <= 2 * rounds, server.gets
    assert 0 < server.gets["/v1/models"] <= 2 * rounds, server.gets
    assert 0 < server.gets["/metrics"] <= 4 * rounds, server.gets
    assert _served_by(gw) == "first"


def test_shared_polls_send_one_get_and_cancel_it_with_its_last_waiter() -> None:
    """`SharedPolls` as a value: two engines' polls of a URL make one GET; one that stops
    waiting leaves it to the other; an answer within `FRESH` is taken as it is; a GET
    every engine stopped waiting for is cancelled."""

    async def scenario() -> None:
        polls = SharedPolls()
        sent: list[asyncio.Task[Any]] = []
        gate = asyncio.Event()

        async def send() -> tuple[int, bytes]:
            sent.append(cast(asyncio.Task[Any], asyncio.current_task()))
            await gate.wait()
            return 200, b"ok"

        first = asyncio.create_task(polls.get("/health", send))
        second = asyncio.create_task(polls.get("/health", send))
        await asyncio.sleep(0)
        first.cancel()
        gate.set()
        assert await second == (200, b"ok")
        assert await polls.get("/health", send) == (200, b"ok")  # answered just now
        assert len(sent) == 1
        await asyncio.sleep(FRESH)
        gate.clear()
        waiting = [asyncio.create_task(polls.get("/health", send)) for _ in range(2)]
        await asyncio.sleep(0)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await asyncio.sleep(0)
        assert len(sent) == 2 and sent[1].cancelled()

    asyncio.run(scenario())


def test_a_metrics_page_becomes_a_load_record_within_its_bounds() -> None:
    """The parser as a value: vLLM's samples summed over engines (the fullest engine's
    KV use), look-alike names and comments ignored, a cut last line not read, values
    that are not counts skipped, a page without the gauges None."""
    page = (
        b"# HELP vllm:num_requests_running Number of requests.\n"
        b'vllm:num_requests_running{engine="0",model_name="a}b"} 2.0\n'
        b'vllm:num_requests_running{engine="1",model_name="a}b"} 1.0 1700000000\n'
        b'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 50.0\n'
        b'vllm:num_requests_waiting{engine="0"} 4.0\n'
        b'vllm:num_requests_waiting{engine="1"} NaN\n'
        b'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        b'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
        b"other:num_requests_waiting 9.0\n"
    )
    assert engine_load(page) == EngineLoad(running=3, waiting=4, kv_usage=0.75)
    cut = page + b'vllm:num_requests_waiting{engine="2"} 7'
    assert engine_load(cut, truncated=True) == EngineLoad(running=3, waiting=4, kv_usage=0.75)
    old = page.replace(b"kv_cache_usage_perc", b"gpu_cache_usage_perc")
    assert engine_load(old) == EngineLoad(running=3, waiting=4, kv_usage=0.75)
    assert engine_load(b"vllm:kv_cache_usage_perc 2.0\nvllm:num_requests_running 1\n") is None
    assert engine_load(b"vllm:num_requests_running 1e30\nvllm:num_requests_waiting -1\n") is None
    huge = engine_load(b"vllm:num_requests_running 1e30\nvllm:num_requests_waiting 0\n")
    assert huge is not None and huge.running == 1 << 31
    assert engine_load(b"<html>not found</html>") is None
    # one data-parallel engine's samples (`data_parallel_size`): its own label alone
    assert engine_load(page, engine=0) == EngineLoad(running=2, waiting=4, kv_usage=0.25)
    assert engine_load(page, engine=1) is None  # its waiting gauge is no count
    fixed = page.replace(b'{engine="1"} NaN', b'{engine="1"} 3.0')
    assert engine_load(fixed, engine=1) == EngineLoad(running=1, waiting=3, kv_usage=0.75)
    assert engine_load(page, engine=2) is None


def test_a_metrics_page_says_which_engines_its_server_runs() -> None:
    """`engine_ranks` as a value: the `engine` labels of the running gauge, in order (the
    other gauges', look-alikes', a cut last line's and labels that are no rank not
    counted), rank 0 for samples without the label, None for a page without the gauge."""
    page = (
        b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        b'vllm:num_requests_running{model_name="m",engine="0"} 0.0\n'
        b'vllm:num_requests_running{engine="1",model_name="n"} 0.0\n'
        b'vllm:num_requests_waiting{engine="2"} 0.0\n'
        b'vllm:num_requests_running_by_reason{engine="3"} 0.0\n'
        b'vllm:num_requests_running{model_engine="4",engine="0"} 1.0\n'
        b'vllm:num_requests_running{engine="-1"} 1.0\n'
    )
    assert engine_ranks(page) == (0, 1)
    assert engine_ranks(page + b'vllm:num_requests_running{engine="9"} 1', truncated=True) == (0, 1)
    assert engine_ranks(page + b'vllm:num_requests_running{engine="9"} 1\n') == (0, 1, 9)
    # a server of hybrid load balancing: a slice of the ranks
    hybrid = b"".join(b'vllm:num_requests_running{engine="%d"} 0\n' % r for r in (9, 8))
    assert engine_ranks(hybrid) == (8, 9)
    assert engine_ranks(b"vllm:num_requests_running 1.0\nvllm:num_requests_waiting 0\n") == (0,)
    assert engine_ranks(b'vllm:num_requests_waiting{engine="0"} 0\n') is None
    assert engine_ranks(b"<html>not found</html>") is None


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_real_vllm_http_servers_metrics_give_a_load_record(
    vllm_http: VllmProcess, gateway_with: Callable[..., Gateway]
) -> None:
    """vLLM's own `/metrics` names, read through the gateway: the record arrives, and a
    request it served counts in it while it runs or after (running + waiting >= 0)."""
    url = f"http://127.0.0.1:{vllm_http.port}/v1"
    model = ModelConfig(
        "tiny-vllm",
        upstream="openai",
        workers=(url,),
        routing=RoutingConfig(policy="least_load", load_interval=0.2),
    )
    gw = gateway_with(models=(model,))
    router = gw.state.fleet.models["tiny-vllm"].router
    assert router is not None

    def record() -> EngineLoad | None:
        kv = router.index.workers.get(url)
        return None if kv is None else kv.load

    wait_until(lambda: record() is not None, "vLLM's load record from its /metrics", HANG_GUARD)
    assert router.scrapes[url] == "loads"
    load = record()
    assert load is not None and 0.0 <= load.kv_usage <= 1.0
    # not a one-word prompt: as a fresh server's first request, vLLM's CPU build lost its
    # engine core to `"prompt": "hello"` (every time, run alone), and took longer ones
    body = {"model": "tiny-vllm", "prompt": "hello there my friend", "max_tokens": 2}
    response = httpx.post(gw.url + "/v1/completions", json=body, timeout=HANG_GUARD * 4)
    assert response.status_code == 200, response.text
    assert router.last.reason == ""  # least_load routed on the record, not the fallback
    # the gateway asks for its gauges alone: vLLM's page, filtered, still gives the record
    root = f"http://127.0.0.1:{vllm_http.port}"
    whole = httpx.get(root + "/metrics", timeout=HANG_GUARD).content
    page = httpx.get(f"{root}/metrics/?{LOAD_QUERY}", timeout=HANG_GUARD).content
    assert engine_load(page) is not None
    upstream = gw.state.fleet.models["tiny-vllm"].workers[url].upstream
    assert getattr(upstream, "metrics_url", None) == f"{root}/metrics/?{LOAD_QUERY}"
    assert b"_bucket" not in page and len(page) * 10 < len(whole), (len(page), len(whole))
