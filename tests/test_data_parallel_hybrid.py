"""vLLM's hybrid load balancing (`--data-parallel-hybrid-lb`), against its CPU build: one
data-parallel group of four engines run by two OpenAI servers, one a node's (here two
processes on loopback, ranks 0-1 and 2-3), each rank publishing its KV events at the
configured port + its rank. Through the gateway (`data_parallel_size: 2`, both servers
listed) the second server's engines are `#dp0` and `#dp1`, pinned by that index (vLLM
takes `data_parallel_rank` as an index among a server's own engines: 2 is out of range
there) and followed by their ranks: the `engine="2"` and `"3"` samples of its
`/metrics`, the publishers at + 2 and + 3. A document stored on rank 3 sends every
prompt that starts with it to the second server's `#dp1`, served from rank 3's cache.
After each test nothing is left in the gateway.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from tests.support.fronts import gateway_over
from tests.support.processes import free_port, free_ports
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left, worker_states
from tests.support.vllm import VllmProcess, start_http_servers
from tests.support.waiting import HANG_GUARD, wait_until
from tests.test_data_parallel import engine_hits
from tests.test_disaggregation import DOCUMENT, RoutedPrompts

#: vLLM's four engines start in the module's setup (a minute on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-dp-hybrid"
#: The group: its size, and the engines each server runs.
GROUP, LOCAL = 4, 2


@pytest.fixture(scope="module")
def servers(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[VllmProcess], int]]:
    """The group's two servers (ranks 0-1, 2-3), and the port its KV events are
    configured at (rank R publishes at that port + R)."""
    port = free_ports(GROUP)
    events = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
    group = (
        *("--served-model-name", MODEL, "--enable-prefix-caching"),
        *("--kv-events-config", events),
        *("--data-parallel-size", str(GROUP), "--data-parallel-size-local", str(LOCAL)),
        *("--data-parallel-hybrid-lb", "--data-parallel-address", "127.0.0.1"),
        *("--data-parallel-rpc-port", str(free_port())),
    )
    nodes = [group, (*group, "--data-parallel-start-rank", str(LOCAL))]
    started = start_http_servers(vllm_model, tmp_path_factory.mktemp("vllm-hybrid"), nodes)
    yield started, port
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    servers: tuple[list[VllmProcess], int],
) -> Iterator[Gateway]:
    processes, port = servers
    urls = tuple(f"http://127.0.0.1:{p.port}/v1" for p in processes)
    model = ModelConfig(
        MODEL,
        upstream="openai",
        workers=urls,
        tokenizer=str(vllm_model),
        data_parallel_size=LOCAL,
        routing=RoutingConfig(kv_events=tuple((url, f"tcp://127.0.0.1:{port}") for url in urls)),
    )
    with gateway_over(server_loop, (model,), workers) as gw:
        yield gw


def test_each_engine_is_followed_by_the_rank_its_server_runs(front, servers, workers):
    processes, _ = servers
    urls = [f"http://127.0.0.1:{p.port}/v1" for p in processes]
    engines = [f"{url}#dp{index}" for url in urls for index in range(LOCAL)]
    healthy = dict.fromkeys(engines, "healthy")
    wait_until(lambda: worker_states(front, MODEL) == healthy, "every engine serving")
    pool = front.state.fleet.models[MODEL]
    ranks = [getattr(pool.workers[e].upstream, "engine_rank", None) for e in engines]
    assert ranks == list(range(GROUP))
    router = pool.router
    assert router is not None
    wait_until(lambda: all(router.scrapes.get(e) == "loads" for e in engines), "each load read")
    ports = {e: int(router.zmq[e].endpoint.rpartition(":")[2]) for e in engines}
    assert [ports[e] - ports[engines[0]] for e in engines] == list(range(GROUP))
    # the second server pins by index: its third engine does not exist
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    refused = httpx.post(
        f"{urls[1]}/completions",
        json=body,
        headers={"X-data-parallel-rank": "2"},
        timeout=HANG_GUARD,
    )
    assert refused.status_code == 400 and "out of range" in refused.text
    assert_nothing_left(front, workers)


def test_a_prompt_goes_to_the_second_servers_engine_that_holds_its_prefix(
    front, servers, workers, caplog
):
    """A document is stored on rank 3 (asked of the second server directly, pinned to its
    second engine). Every prompt that starts with it then goes, through the gateway, to
    that server's `#dp1`, and rank 3's cache serves it; rank 2's sees none of them."""
    processes, _ = servers
    second = processes[1]
    url = f"http://127.0.0.1:{second.port}/v1"
    holder = f"{url}#dp1"
    caplog.set_level(logging.INFO, logger="furnace.access")
    routed = RoutedPrompts(front, MODEL, caplog, prefill=False)
    index = routed.router.index
    document = f"{uuid.uuid4().hex} {DOCUMENT}"

    def stored() -> bool:
        body = {"model": MODEL, "prompt": document, "max_tokens": 1}
        headers = {"X-data-parallel-rank": "1"}
        pinned = httpx.post(f"{url}/completions", json=body, headers=headers, timeout=HANG_GUARD)
        assert pinned.status_code == 200, pinned.text
        kv = index.workers.get(holder)
        return kv is not None and bool(kv.blocks)

    # its publisher's subscription may come after the first store: asked again
    wait_until(stored, "the document's blocks on rank 3", 60)
    before = engine_hits(second, 3), engine_hits(second, 2)
    for i in range(3):
        line = routed.complete(f"{document} and then {i}")
        assert line["worker"] == holder
        assert line["cache_hit_blocks"] >= 2
    assert engine_hits(second, 3) > before[0]
    assert engine_hits(second, 2) == before[1]
    assert_nothing_left(front, workers)
