"""Data-parallel vLLM servers (`models[].data_parallel_size`), against vLLM's CPU build: an
OpenAI server of the tiny model started with `--data-parallel-size 2`, two engines behind
one address, each publishing its KV events on its own ZMQ port (the configured one, and
one more). Through the gateway each engine is a worker (`URL#dp0`, `URL#dp1`), followed
on its own events and `/metrics` samples; once one engine holds a document's blocks,
every prompt that starts with the document is pinned to that engine (vLLM's
`X-data-parallel-rank`) and served from its cache: its own prefix-cache hits grow, the
other's do not. The same over vLLM's gRPC server of two engines (`upstream: vllm-grpc`),
each engine followed on the relay's batches of its rank and pinned with
`data_parallel_rank`, its `cached_tokens` saying its cache served. After each test nothing
is left in the gateway.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from gateway.config import ModelConfig, RoutingConfig
from gateway.tokenization import load_tokenizer
from tests.support.fronts import gateway_over
from tests.support.metrics import scrape, value
from tests.support.processes import free_ports
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left, worker_states
from tests.support.vllm import (
    VllmProcess,
    kv_events_args,
    start_grpc_server,
    start_http_server,
)
from tests.support.waiting import HANG_GUARD, wait_until
from tests.test_disaggregation import DOCUMENT, RoutedPrompts

#: vLLM's engines start in the first test's setup (tens of seconds on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-dp"
#: The same server given three engines, and given as one worker.
THREE, ONE = "tiny-dp-3", "tiny-dp-1"
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def server(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmProcess, int]]:
    """The server of two engines, and the port its rank 0 publishes on (rank 1: the next)."""
    port = free_ports(2)
    logs = tmp_path_factory.mktemp("vllm-dp")
    names = ("--served-model-name", MODEL, THREE, ONE)  # the last one given wins
    extra = (*names, "--data-parallel-size", "2", *kv_events_args(port))
    with start_http_server(vllm_model, logs, MODEL, extra=extra) as process:
        yield process, port


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    server: tuple[VllmProcess, int],
) -> Iterator[Gateway]:
    process, port = server
    url = f"http://127.0.0.1:{process.port}/v1"
    model = ModelConfig(
        MODEL,
        upstream="openai",
        workers=(url,),
        tokenizer=str(vllm_model),
        data_parallel_size=2,
        routing=RoutingConfig(kv_events=((url, f"tcp://127.0.0.1:{port}"),)),
    )
    with gateway_over(server_loop, (model,), workers) as gw:
        yield gw


def engine_hits(process: VllmProcess, engine: int) -> float:
    """One engine's prefix-cache hits, in tokens (its samples' label `engine`: its rank)."""
    samples = scrape(f"http://127.0.0.1:{process.port}")
    rank = ("engine", str(engine))
    return sum(v for (name, labels), v in samples.items() if name == HITS and rank in labels)


def test_each_engine_is_a_worker_followed_on_its_own_events_and_load(front, server, workers):
    process, _ = server
    url = f"http://127.0.0.1:{process.port}/v1"
    engines = (f"{url}#dp0", f"{url}#dp1")
    pool = front.state.fleet.models[MODEL]
    assert sorted(pool.workers) == list(engines)
    assert pool.router is not None
    router = pool.router
    wait_until(lambda: all(router.scrapes.get(e) == "loads" for e in engines), "both loads read")
    view = next(m for m in front.state.fleet.snapshot()["models"] if m["name"] == MODEL)
    assert {w["address"]: w["state"] for w in view["workers"]} == dict.fromkeys(engines, "healthy")
    samples = scrape(front.url)
    for engine in engines:
        assert (
            value(
                samples,
                "furnace_gateway_worker_healthy",
                model=MODEL,
                worker=engine,
                state="healthy",
            )
            == 1
        )
    assert_nothing_left(front, workers)


def test_a_prompt_is_pinned_to_the_engine_that_holds_its_prefix(front, server, workers, caplog):
    """A document is stored on engine 1 (asked of the server directly, pinned there). Left
    to itself, vLLM sends a prompt to its least loaded engine, the first of two idle ones:
    engine 0, which does not hold it. Through the gateway every prompt that starts with
    the document goes to engine 1 and is served from its cache."""
    process, _ = server
    url = f"http://127.0.0.1:{process.port}/v1"
    holder = f"{url}#dp1"
    caplog.set_level(logging.INFO, logger="furnace.access")
    routed = RoutedPrompts(front, MODEL, caplog, prefill=False)
    index = routed.router.index
    document = f"{uuid.uuid4().hex} {DOCUMENT}"
    body = {"model": MODEL, "prompt": document, "max_tokens": 1}
    pinned = httpx.post(
        f"{url}/completions", json=body, headers={"X-data-parallel-rank": "1"}, timeout=HANG_GUARD
    )
    assert pinned.status_code == 200, pinned.text
    wait_until(lambda: index.workers.get(holder) and index.workers[holder].blocks, "its blocks")
    before = engine_hits(process, 1), engine_hits(process, 0)
    for i in range(4):
        line = routed.complete(f"{document} and then {i}")
        assert line["worker"] == holder
        assert line["cache_hit_blocks"] >= 2  # the document's blocks, by ids
    assert engine_hits(process, 1) > before[0]  # its cache served them
    assert engine_hits(process, 0) == before[1]  # the other engine saw none of them
    samples = scrape(front.url)
    kv = "furnace_gateway_worker_kv_cached_blocks"
    assert value(samples, kv, model=MODEL, worker=holder) > 0
    assert routed.router.states[holder] == "events"
    assert_nothing_left(front, workers)


#: The same model over vLLM's gRPC server of two engines (`upstream: vllm-grpc`).
GRPC_MODEL = "tiny-dp-grpc"


def assert_engines_checked(
    gw: Gateway, address: str, three: str, one: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server of two engines at `address`, given three (model `three`): its third
    engine is kept out, the others serve, the log says why; given as one worker (model
    `one`): the log says it runs two."""
    wait_until(
        lambda: worker_states(gw, three).get(f"{address}#dp2") == "no_such_engine",
        "the engine its server does not run kept out",
    )
    assert worker_states(gw, three)[f"{address}#dp1"] == "healthy"
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "furnace.fleet")
    assert f"{address}#dp2 of {three}: its server runs 2 data-parallel engines" in said
    wait_until(
        lambda: (
            f"{address} of {one} runs 2 data-parallel engines, routed as one"
            in " ".join(r.getMessage() for r in caplog.records if r.name == "furnace.fleet")
        ),
        "the server's other engine said",
    )


def test_an_http_servers_engines_are_read_from_its_metrics(server_loop, workers, server, caplog):
    """vLLM's OpenAI server says nothing of its engines but in `/metrics` (their label
    `engine`): given one engine too many, the third is kept out (`no_such_engine`) and
    every request goes to the two it runs; given as one worker, the log says it runs
    two."""
    process, _ = server
    url = f"http://127.0.0.1:{process.port}/v1"
    three = ModelConfig(THREE, upstream="openai", workers=(url,), data_parallel_size=3)
    one = ModelConfig(ONE, upstream="openai", workers=(url,))
    with gateway_over(server_loop, (three, one), workers) as gw:
        assert_engines_checked(gw, url, THREE, ONE, caplog)
        body = {"model": THREE, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
            for _ in range(4):
                answer = client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
        assert_nothing_left(gw, workers)


@pytest.fixture(scope="module")
def grpc_server(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """vLLM's gRPC server of two engines, relaying both ranks' KV events."""
    logs = tmp_path_factory.mktemp("vllm-dp-grpc")
    extra = ("--data-parallel-size", "2", *kv_events_args(free_ports(2)))
    with start_grpc_server(vllm_model, logs, extra) as process:
        yield process


def _pin_document(address: str, model: Path, document: str, rank: int) -> None:
    """`document` prefilled on engine `rank` of the gRPC server, asked of it directly,
    its ids as the gateway encodes a completion's prompt."""
    ids = load_tokenizer(str(model)).routing_ids(document, None, ())
    request = pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(max_tokens=1),
        stream=False,
        data_parallel_rank=rank,
    )
    with grpc.insecure_channel(address) as channel:
        for _ in pb_grpc.VllmEngineStub(channel).Generate(request, timeout=HANG_GUARD):
            pass


def test_over_vllms_grpc_server_a_prompt_is_pinned_to_the_engine_that_holds_its_prefix(
    server_loop, workers, vllm_model, grpc_server, caplog
):
    """Each engine followed on the relay's batches of its rank; the document stored on
    engine 1, every prompt that starts with it is sent with `data_parallel_rank` 1 and
    served from that engine's cache (its `cached_tokens`), where vLLM left to itself
    would pick idle engine 0."""
    address = f"127.0.0.1:{grpc_server.port}"
    holder = f"{address}#dp1"
    model = ModelConfig(
        GRPC_MODEL,
        upstream="vllm-grpc",
        tokenizer=str(vllm_model),
        workers=(address,),
        data_parallel_size=2,
        routing=RoutingConfig(),
    )
    # the same server given one engine too many, and given as one worker
    three, one = (
        replace(model, name="tiny-dp-grpc-3", data_parallel_size=3),
        replace(model, name="tiny-dp-grpc-1", data_parallel_size=1),
    )
    with gateway_over(server_loop, (model, three, one), workers) as gw:
        states = worker_states(gw, GRPC_MODEL)
        assert_engines_checked(gw, address, three.name, one.name, caplog)
        assert set(states.values()) <= {"healthy", "unknown"}
        caplog.set_level(logging.INFO, logger="furnace.access")
        routed = RoutedPrompts(gw, GRPC_MODEL, caplog, prefill=False)
        index = routed.router.index
        # the relay sends only what its engines publish after the subscription: a new
        # document each time until the index holds engine 1's blocks of one
        wait_until(lambda: len(routed.router.owners) == 2, "both engines followed")
        for attempt in range(5):
            document = f"{uuid.uuid4().hex} {attempt} {DOCUMENT}"
            _pin_document(address, vllm_model, document, 1)
            try:
                wait_until(
                    lambda: bool(index.workers.get(holder, None) and index.workers[holder].blocks),
                    "its blocks",
                    10,
                )
                break
            except AssertionError:
                continue
        else:
            raise AssertionError("engine 1's blocks never reached the index")
        assert not index.workers.get(f"{address}#dp0") or not index.workers[f"{address}#dp0"].blocks
        # both engines read one stream of the server's, each its rank's batches
        engines = gw.state.fleet.models[GRPC_MODEL].workers.values()
        (shared,) = {
            id(w.upstream.ranked_events): w.upstream.ranked_events for w in engines
        }.values()
        assert sorted(shared._followers) == [0, 1] and shared._reader is not None
        for i in range(3):
            line = routed.complete(f"{document} and then {i}")
            assert line["worker"] == holder
            assert line["cache_hit_blocks"] >= 2
            assert line["cached_tokens"] >= 2 * index.block_size  # its engine's own count
        assert_nothing_left(gw, workers)
