"""Prefill/decode disaggregation on vLLM's gRPC servers (`upstream: vllm-grpc` with
`prefill_workers`), where the gateway renders and tokenizes: two gRPC servers of the tiny
model with vLLM's NixlConnector, one that prefills, one that decodes. The prompt's ids are
made once, for the prefill (one token, `kv_transfer_params_json` asking for the blocks
to be kept) and the decode call (with where they are, as the prefill's `GenerateComplete`
said). Every answer equals the same decode server's without the split (a second model of
the gateway on it alone), whole and streamed; a prefill worker nobody listens on leaves the
decode worker to prefill; with a second prefill server and `routing`, the prefill tier is
routed on the servers' own KV events. After each test nothing is left in the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from gateway.config import ModelConfig, RoutingConfig
from tests.support.fronts import checked_sdk, gateway_over
from tests.support.metrics import scrape, value
from tests.support.processes import free_port
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left, worker_states
from tests.support.vllm import VllmProcess, kv_events_args, nixl_args, start_grpc_server
from tests.support.waiting import wait_until
from tests.test_disaggregation import RoutedPrompts, fresh

#: vLLM's engines start in the first test's setup (tens of seconds on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SPLIT = "tiny-pd-grpc"
#: The decode server alone (it prefills itself), to compare with.
ALONE = "tiny-grpc-alone"
#: The decode server behind a prefill worker nobody listens on.
UNREACHABLE = "tiny-grpc-unreachable-prefill"
#: The decode server behind a server without a KV connector as its prefill worker, and
#: that server as the decode worker behind the prefill server.
UNCONNECTED_PREFILL = "tiny-grpc-unconnected-prefill"
UNCONNECTED_DECODE = "tiny-grpc-unconnected-decode"


@pytest.fixture(scope="module")
def servers(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmProcess, VllmProcess]]:
    """The prefill server and the decode server."""
    with ExitStack() as stack:  # each stopped, the last started first
        started: list[VllmProcess] = []
        for role in ("kv_producer", "kv_consumer"):
            extra, env = nixl_args(role)
            logs = tmp_path_factory.mktemp(f"vllm-grpc-{role}")
            events = kv_events_args() if role == "kv_producer" else ()
            server = start_grpc_server(vllm_model, logs, (*extra, *events), env)
            started.append(stack.enter_context(server))
        yield started[0], started[1]


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    servers: tuple[VllmProcess, VllmProcess],
    vllm_grpc: VllmProcess,
) -> Iterator[Gateway]:
    prefill, decode = (f"127.0.0.1:{s.port}" for s in servers)
    unconnected = f"127.0.0.1:{vllm_grpc.port}"  # the session's plain vLLM gRPC server

    def model(name: str, prefill_workers: tuple[str, ...], worker: str = decode) -> ModelConfig:
        return ModelConfig(
            name,
            upstream="vllm-grpc",
            tokenizer=str(vllm_model),
            workers=(worker,),
            prefill_workers=prefill_workers,
        )

    models = (
        model(SPLIT, (prefill,)),
        model(ALONE, ()),
        model(UNREACHABLE, (f"127.0.0.1:{free_port()}",)),
        model(UNCONNECTED_PREFILL, (unconnected,)),
        model(UNCONNECTED_DECODE, (prefill,), worker=unconnected),
    )
    with gateway_over(server_loop, models, workers) as gw:
        yield gw


@pytest.fixture
def client(front: Gateway, workers: Workers) -> Iterator[openai.OpenAI]:
    """The official SDK to the gateway; after the test, nothing left in it."""
    with checked_sdk(front, workers) as sdk:
        yield sdk


def _prefills(front: Gateway, model: str, outcome: str) -> float:
    return value(scrape(front.url), "furnace_gateway_prefills_total", model=model, outcome=outcome)


def test_a_chat_prefilled_on_the_prefill_server_is_the_decode_servers_own_answer(client, front):
    messages = [{"role": "user", "content": fresh()}]
    before = _prefills(front, SPLIT, "transferred")
    split = client.chat.completions.create(
        model=SPLIT, messages=messages, max_tokens=12, temperature=0
    )
    assert _prefills(front, SPLIT, "transferred") == before + 1
    alone = client.chat.completions.create(
        model=ALONE, messages=messages, max_tokens=12, temperature=0
    )
    assert split.choices[0].message.content == alone.choices[0].message.content
    assert split.usage.prompt_tokens == alone.usage.prompt_tokens
    assert split.usage.completion_tokens == alone.usage.completion_tokens == 12


def test_a_streamed_completion_with_several_choices_is_decoded_after_a_prefill(client, front):
    prompt = fresh()
    before = _prefills(front, SPLIT, "transferred")
    finished: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=SPLIT,
        prompt=prompt,
        max_tokens=6,
        n=2,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert finished == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12
    assert _prefills(front, SPLIT, "transferred") == before + 1


def _answers_as_alone(client: openai.OpenAI, model: str) -> None:
    """A chat of `model` is answered as the decode server alone answers it."""
    messages = [{"role": "user", "content": fresh()}]
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    alone = client.chat.completions.create(
        model=ALONE, messages=messages, max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content == alone.choices[0].message.content


def test_without_a_prefill_worker_to_reach_the_decode_worker_prefills(client, front):
    _answers_as_alone(client, UNREACHABLE)
    assert _prefills(front, UNREACHABLE, "no_worker") >= 1


def test_a_server_without_a_kv_connector_is_kept_out_of_either_tier(client, front, vllm_grpc):
    """Its `GetServerInfo` names no `kv_connector`: as a prefill worker its blocks would be
    unclaimed (its answer has no `kv_transfer_params`), as a decode worker it would
    prefill again and leave the prefill server holding the blocks until vLLM's abort
    timeout. Kept out, said in `/admin/workers` and the metrics; the decode worker
    prefills itself, and a model with no decode worker left is not prefilled at all."""
    unconnected = f"127.0.0.1:{vllm_grpc.port}"
    wait_until(
        lambda: (
            worker_states(front, UNCONNECTED_PREFILL, "prefill_workers")[unconnected]
            == "no_kv_connector"
        ),
        "the prefill worker without a connector kept out",
    )
    _answers_as_alone(client, UNCONNECTED_PREFILL)  # the decode server prefilled itself
    assert _prefills(front, UNCONNECTED_PREFILL, "no_worker") == 1
    assert _prefills(front, UNCONNECTED_PREFILL, "failed") == 0
    samples = scrape(front.url)
    healthy = "furnace_gateway_worker_healthy"
    labels = {"model": UNCONNECTED_PREFILL, "worker": unconnected, "state": "no_kv_connector"}
    assert value(samples, healthy, **labels) == 0
    wait_until(
        lambda: worker_states(front, UNCONNECTED_DECODE)[unconnected] == "no_kv_connector",
        "the decode worker without a connector kept out",
    )
    messages = [{"role": "user", "content": fresh()}]
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=UNCONNECTED_DECODE, messages=messages, max_tokens=4)
    assert refused.value.status_code == 503
    assert _prefills(front, UNCONNECTED_DECODE, "transferred") == 0  # no prefill made for it
    # the servers with a connector fit their tiers
    tiers = (worker_states(front, SPLIT), worker_states(front, SPLIT, "prefill_workers"))
    assert {state for tier in tiers for state in tier.values()} == {"healthy"}


@pytest.fixture(scope="module")
def second_prefill(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """One more prefill server, its KV events relayed on its `SubscribeKvEvents`."""
    extra, env = nixl_args("kv_producer")
    logs = tmp_path_factory.mktemp("vllm-grpc-kv_producer-2")
    with start_grpc_server(vllm_model, logs, (*extra, *kv_events_args()), env) as server:
        yield server


def test_prefill_servers_routed_on_their_kv_events_prefill_a_shared_prefix_where_it_is_cached(
    server_loop, workers, vllm_model, servers, second_prefill, caplog
):
    """Over vLLM's gRPC servers the prefill tier is routed on each server's
    `SubscribeKvEvents` and the ids the gateway made once for the prefill and the decode."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    prefills = tuple(f"127.0.0.1:{s.port}" for s in (servers[0], second_prefill))
    model = ModelConfig(
        SPLIT,
        upstream="vllm-grpc",
        tokenizer=str(vllm_model),
        workers=(f"127.0.0.1:{servers[1].port}",),
        prefill_workers=prefills,
        routing=RoutingConfig(),
    )
    with gateway_over(server_loop, (model,), workers) as gw:
        routed = RoutedPrompts(gw, SPLIT, caplog)
        document, holder = routed.stored()
        for i in range(3):
            line = routed.complete(f"{document} and then {i}")
            assert line["prefill_worker"] == holder
            assert line["prefill_cache_hit_blocks"] >= 1  # by the ids the gateway made
        assert _prefills(gw, SPLIT, "transferred") >= 4
        assert_nothing_left(gw, workers)
