"""Prefill/decode disaggregation (`models[].prefill_workers`), against vLLM's CPU build:
two OpenAI servers of the tiny model with vLLM's NixlConnector (NIXL over UCX, moving
host memory), one that prefills (`kv_producer`), one that decodes (`kv_consumer`).
Through the gateway each prompt is prefilled on the first, one token and no more (its
counters say so), and its KV blocks are pulled by the second (vLLM's own transfer counter
says so); every answer (chats and completions, whole and streamed, several choices, the
Responses API, Anthropic's Messages) is the decode server's own answer to the same body.
A prefill worker the gateway cannot reach leaves the decode worker to prefill: the answer
comes all the same, and the prefill is counted failed. After each test nothing is left in
the gateway.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import ModelConfig, RoutingConfig
from tests.support.fronts import checked_sdk, gateway_over
from tests.support.metrics import access_lines, scrape, value
from tests.support.openai_server import keyed_plain
from tests.support.processes import free_port
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left
from tests.support.vllm import VllmProcess, kv_events_args, nixl_args, start_http_server
from tests.support.waiting import HANG_GUARD, wait_until

#: vLLM's engines start in the first test's setup (tens of seconds on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-pd"
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"


def _nixl_server(model: Path, logs: Path, role: str, events: tuple[str, ...] = ()) -> VllmProcess:
    """vLLM's OpenAI server of the tiny model with the NixlConnector in `role` (and
    `events`: `kv_events_args`)."""
    extra, env = nixl_args(role)
    return start_http_server(model, logs, MODEL, extra=(*extra, *events), env=env)


@pytest.fixture(scope="module")
def events_port() -> int:
    """Where the prefill server's engine publishes its KV events (ZMQ)."""
    return free_port()


@pytest.fixture(scope="module")
def servers(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory, events_port: int
) -> Iterator[tuple[VllmProcess, VllmProcess]]:
    """The prefill server, publishing its KV events on `events_port`, and the decode server."""
    with ExitStack() as stack:  # each stopped, the last started first
        started: list[VllmProcess] = []
        for role, events in (("kv_producer", kv_events_args(events_port)), ("kv_consumer", ())):
            logs = tmp_path_factory.mktemp(f"vllm-{role}")
            started.append(stack.enter_context(_nixl_server(vllm_model, logs, role, events)))
        yield started[0], started[1]


def _url(server: VllmProcess) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop, workers: Workers, servers: tuple[VllmProcess, VllmProcess]
) -> Iterator[Gateway]:
    prefill, decode = servers
    models = (
        ModelConfig(
            MODEL, upstream="openai", workers=(_url(decode),), prefill_workers=(_url(prefill),)
        ),
    )
    with gateway_over(server_loop, models, workers) as gw:
        yield gw


@pytest.fixture
def client(front: Gateway, workers: Workers) -> Iterator[openai.OpenAI]:
    """The official SDK to the gateway; after the test, nothing left in it."""
    with checked_sdk(front, workers) as sdk:
        yield sdk


def _counted(server: VllmProcess, name: str) -> float:
    """The sum of a vLLM counter's samples."""
    samples = scrape(f"http://127.0.0.1:{server.port}")
    return sum(v for (sample, _), v in samples.items() if sample == name)


class Counts:
    """What the two servers counted over a test's requests: the decode server's
    transfers, the prefill server's prompts and generated tokens."""

    def __init__(self, servers: tuple[VllmProcess, VllmProcess]) -> None:
        self.prefill, self.decode = servers
        self.before = self._now()

    def _now(self) -> tuple[float, float, float]:
        return (
            _counted(self.decode, TRANSFERS),
            _counted(self.prefill, "vllm:prompt_tokens_total"),
            _counted(self.prefill, "vllm:generation_tokens_total"),
        )

    def since(self) -> tuple[float, float, float]:
        """Transfers, prompt tokens prefilled and tokens generated on the prefill server."""
        now = self._now()
        return (now[0] - self.before[0], now[1] - self.before[1], now[2] - self.before[2])


def fresh(words: int = 40) -> str:
    """A prompt no server has cached (a cached one is not transferred)."""
    return f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(words))


def _direct(servers: tuple[VllmProcess, VllmProcess], path: str, body: dict[str, Any]) -> Any:
    """The decode server's own answer to `body`, reached directly (it prefills itself)."""
    answer = httpx.post(f"{_url(servers[1])}/{path}", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_chat_is_prefilled_on_the_prefill_worker_and_decoded_with_its_kv_cache(
    client, front, servers, caplog
):
    caplog.set_level(logging.INFO, logger="furnace.access")
    messages = [{"role": "user", "content": fresh()}]
    counts = Counts(servers)
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    transfers, prefilled, generated = counts.since()
    own = _direct(
        servers,
        "chat/completions",
        {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0},
    )
    assert answer.choices[0].message.content == own["choices"][0]["message"]["content"]
    assert answer.usage.prompt_tokens == own["usage"]["prompt_tokens"]
    assert answer.usage.completion_tokens == own["usage"]["completion_tokens"]
    # the prefill server ran the prompt and one token; the decode server pulled the blocks
    assert (transfers, prefilled, generated) == (1, answer.usage.prompt_tokens, 1)
    samples = scrape(front.url)
    assert value(samples, "furnace_gateway_prefills_total", model=MODEL, outcome="transferred")
    assert value(samples, "furnace_gateway_model_healthy_prefill_workers", model=MODEL) == 1
    prefill_url = _url(servers[0])
    assert (
        value(samples, "furnace_gateway_worker_inflight_requests", model=MODEL, worker=prefill_url)
        == 0
    )
    view = next(m for m in front.state.fleet.snapshot()["models"] if m["name"] == MODEL)
    assert [w["address"] for w in view["prefill_workers"]] == [prefill_url]
    wait_until(lambda: access_lines(caplog), "the request's access-log line")
    line = access_lines(caplog)[-1]
    assert (line["worker"], line["prefill_worker"]) == (_url(servers[1]), prefill_url)


def test_a_client_that_leaves_during_the_prefill_leaves_nothing_behind(front, workers, servers):
    """The prefill of a long prompt takes the CPU engine a good part of a second; the
    client gives up long before (the leak check: no call left on either worker)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": fresh(150)}]}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(front.url + "/v1/chat/completions", json=body, timeout=0.05)
    assert_nothing_left(front, workers)


def test_a_streamed_chat_with_several_choices_is_decoded_from_the_transferred_blocks(
    client, servers
):
    messages = [{"role": "user", "content": fresh()}]
    counts = Counts(servers)
    finished = [None, None]
    usage = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=1.0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in chunk.choices:
            finished[choice.index] = choice.finish_reason or finished[choice.index]
        usage = chunk.usage or usage
    transfers, prefilled, generated = counts.since()
    assert finished == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 16
    assert (prefilled, generated) == (usage.prompt_tokens, 1)  # one prefill, one token
    assert transfers == 2  # each choice pulled the prompt's blocks


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_is_disaggregated_too(client, servers, stream):
    prompt = fresh()
    counts = Counts(servers)
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    if stream:
        text = "".join(
            c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices
        )
    else:
        text = client.completions.create(**body).choices[0].text
    assert counts.since()[0] == 1
    assert text == _direct(servers, "completions", body)["choices"][0]["text"]


def test_the_responses_api_and_anthropic_messages_are_disaggregated(client, front, servers):
    counts = Counts(servers)
    response = client.responses.create(model=MODEL, input=fresh(), max_output_tokens=16)
    assert response.status == "completed" or response.incomplete_details is not None
    claude = anthropic.Anthropic(base_url=front.url, api_key="unused", timeout=HANG_GUARD)
    with claude.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": fresh()}]
    ) as stream:
        message = stream.get_final_message()
    assert message.usage.output_tokens > 0
    transfers, _, generated = counts.since()
    assert (transfers, generated) == (2, 2)


def _gateway_with_prefill(
    server_loop: ServerLoop,
    workers: Workers,
    decode: VllmProcess,
    prefill: tuple[str, ...],
    **extra: Any,
) -> AbstractContextManager[Gateway]:
    models = (
        ModelConfig(
            MODEL, upstream="openai", workers=(_url(decode),), prefill_workers=prefill, **extra
        ),
    )
    return gateway_over(server_loop, models, workers)


def _served_all_the_same(gw: Gateway, servers: tuple[VllmProcess, VllmProcess]) -> None:
    """A chat through `gw` is the decode server's own answer, prefilled there."""
    messages = [{"role": "user", "content": fresh()}]
    counts = Counts(servers)
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    own = _direct(servers, "chat/completions", body)
    assert (
        answer.json()["choices"][0]["message"]["content"]
        == (own["choices"][0]["message"]["content"])
    )
    assert counts.since() == (0, 0, 0)  # the decode server prefilled it itself


def test_without_a_prefill_worker_to_reach_the_decode_worker_prefills(
    server_loop, workers, servers
):
    unreachable = (f"http://127.0.0.1:{free_port()}/v1",)
    with _gateway_with_prefill(server_loop, workers, servers[1], unreachable) as gw:
        _served_all_the_same(gw, servers)
        samples = scrape(gw.url)
        assert value(samples, "furnace_gateway_prefills_total", model=MODEL, outcome="no_worker")
        assert value(samples, "furnace_gateway_model_healthy_prefill_workers", model=MODEL) == 0
        assert_nothing_left(gw, workers)


def test_a_prefill_answered_without_kv_transfer_params_leaves_the_decode_worker_to_prefill(
    server_loop, workers, servers
):
    """A prefill worker that runs no KV connector (here an OpenAI-compatible server that
    is no vLLM) answers the prefill, but says nowhere where its blocks are."""
    with (
        keyed_plain(server_loop, MODEL, "PD_KEY", "hello") as stand_in,
        _gateway_with_prefill(
            server_loop,
            workers,
            servers[1],
            (f"http://127.0.0.1:{stand_in.port}/v1",),
            api_key_env="PD_KEY",
        ) as gw,
    ):
        _served_all_the_same(gw, servers)
        samples = scrape(gw.url)
        assert value(samples, "furnace_gateway_prefills_total", model=MODEL, outcome="failed")
        assert_nothing_left(gw, workers)
    # the prefill as vLLM's NixlConnector takes it: one token, whole, its blocks kept
    sent = stand_in.last_body
    assert (sent["max_tokens"], sent["stream"]) == (1, False)
    assert "stream_options" not in sent and "n" not in sent
    assert sent["kv_transfer_params"]["do_remote_decode"] is True


@pytest.fixture(scope="module")
def second_prefill(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmProcess, int]]:
    """One more prefill server, publishing its KV events on the port it comes with."""
    port = free_port()
    logs = tmp_path_factory.mktemp("vllm-kv_producer-2")
    with _nixl_server(vllm_model, logs, "kv_producer", kv_events_args(port)) as server:
        yield server, port


#: A prompt of several KV blocks, the start every request below shares.
DOCUMENT = " ".join(f"line {i} of the shared document," for i in range(30))


class RoutedPrompts:
    """Completions of `model` through `gw`, whose prefill tier (or, not `prefill`, its
    workers) is routed, each with its access-log line (`caplog` at INFO for
    furnace.access)."""

    def __init__(
        self, gw: Gateway, model: str, caplog: pytest.LogCaptureFixture, prefill: bool = True
    ) -> None:
        self.gw, self.model, self.caplog = gw, model, caplog
        pool = gw.state.fleet.models[model]
        routed = pool.prefill if prefill else pool
        assert routed is not None and routed.router is not None
        self.router = routed.router

    def complete(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(self.gw.url + "/v1/completions", json=body, timeout=HANG_GUARD)
        assert answer.status_code == 200, answer.text
        wait_until(lambda: access_lines(self.caplog), "the request's access-log line")
        return access_lines(self.caplog)[-1]

    def stored(self) -> tuple[str, str]:
        """A new document, asked again until the index holds one worker's blocks
        of it (a subscription misses what its engine published before it was made: a ZMQ
        SUB socket connects late, vLLM's gRPC relay is live only), and that worker."""
        index = self.router.index
        for attempt in range(5):
            document = f"{uuid.uuid4().hex} {attempt} {DOCUMENT}"
            self.complete(document)
            try:
                wait_until(lambda: bool(index.holders), "the document's blocks", 20)
            except AssertionError:
                continue
            (holder,) = [address for address, kv in index.workers.items() if kv.blocks]
            self.caplog.clear()
            return document, holder
        raise AssertionError("no blocks of 5 documents in the prefill tier's index")


def test_prefill_workers_routed_on_their_kv_events_prefill_a_shared_prefix_where_it_is_cached(
    server_loop, workers, servers, second_prefill, events_port, vllm_model, caplog
):
    """Two prefill servers publish their engines' KV events over ZMQ; with `routing`, the
    prefill tier is routed on them: once one of them holds a document's blocks, every
    prompt that starts with the document is prefilled there, from its cache."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    other, other_port = second_prefill
    urls = (_url(servers[0]), _url(other))
    ends = (f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{other_port}")
    routing = RoutingConfig(kv_events=tuple(zip(urls, ends, strict=True)))
    with _gateway_with_prefill(
        server_loop, workers, servers[1], urls, tokenizer=str(vllm_model), routing=routing
    ) as gw:
        routed = RoutedPrompts(gw, MODEL, caplog)
        document, holder = routed.stored()
        assert routed.router.states[holder] == "events"
        server = servers[0] if holder == urls[0] else other
        hits = _counted(server, "vllm:prefix_cache_hits_total")
        for i in range(4):
            line = routed.complete(f"{document} and then {i}")
            assert line["prefill_worker"] == holder
            assert line["prefill_cache_hit_blocks"] >= 2  # the document's blocks, by ids
        assert _counted(server, "vllm:prefix_cache_hits_total") > hits  # its cache served
        samples = scrape(gw.url)
        assert value(samples, "furnace_gateway_worker_kv_cached_blocks", model=MODEL, worker=holder)
        assert value(samples, "furnace_gateway_prefills_total", model=MODEL, outcome="transferred")
        # the decode tier publishes no events: each request fell back there, and its prefill
        # was routed on the events (the four after the document's blocks were held, at least)
        fallbacks = "furnace_gateway_routing_fallbacks_total"
        decode = value(samples, fallbacks, model=MODEL, tier="workers")
        assert decode >= 5
        assert value(samples, fallbacks, model=MODEL, tier="prefill_workers") <= decode - 4
        view = next(m for m in gw.state.fleet.snapshot()["models"] if m["name"] == MODEL)
        views = {w["address"]: w["routing"] for w in view["prefill_workers"]}
        assert views[holder]["events"] == "events"
        assert_nothing_left(gw, workers)
