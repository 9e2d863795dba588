"""Specs: the OpenAI Agents SDK, whose default model API is the Responses API, runs an
agent's loop to its final answer against the gateway: a turn that calls a function
tool, the SDK running the tool, a turn that answers from the tool's output; streamed
as well. The demo calls a tool whose name is a word of the last message and echoes
the last message otherwise (`gateway.worker.demo`). With `ModelSettings(truncation="auto")`,
a conversation longer than the demo's context runs with its earlier turn dropped.

Against vLLM's engine too (its gRPC server, `upstream: vllm-grpc`, the gateway rendering
the tiny model's tools template): the random model's first turn is a tool call forced
by `tool_choice` and held to the tool's schema by vLLM's grammar; the SDK then resets
the choice, as it does by default, and the second turn's answer is the agent's output
type, held to its JSON schema by the same grammar (a random model's free text would run
to `max_output_tokens`, an incomplete response the SDK refuses)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from gateway.config import ModelConfig
from tests.support.servers import (
    DEMO_MODEL,
    Gateway,
    ServerLoop,
    Workers,
    assert_nothing_left,
    make_config,
    start_gateway,
)
from tests.support.tiny_model import tools_tokenizer
from tests.support.vllm import VllmProcess
from tests.support.waiting import HANG_GUARD

VLLM_TOOLS_MODEL = "tiny-vllm-tools"


@dataclass
class Forecast:
    """The vLLM agent's structured answer."""

    sky: Literal["sunny", "rainy"]


@pytest.fixture(autouse=True)
def _no_tracing():
    # the SDK would export its traces to OpenAI's servers
    set_tracing_disabled(True)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD
    )


def _agent(
    client: openai.AsyncOpenAI, calls: list[str], settings: ModelSettings | None = None
) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny and warm"

    return Agent(
        name="forecaster",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(DEMO_MODEL, client),
        model_settings=settings or ModelSettings(),
    )


def test_an_agent_runs_a_function_tool_to_its_final_answer(gateway):
    calls: list[str] = []

    async def run() -> Any:
        async with _client(gateway.url) as client:
            return await Runner.run(_agent(client, calls), "please get_weather for Paris")

    result = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert calls == [""]  # the demo's minimal instance of {"city": string}
    assert result.final_output == "sunny and warm"
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(result.raw_responses) == 2


def test_an_agent_with_truncation_runs_a_conversation_longer_than_the_context(gateway):
    calls: list[str] = []
    # the instructions' 4 words, 30 + 30, the request's 4: past the demo's 64 tokens
    history = [
        {"role": "user", "content": " ".join(f"a{i}" for i in range(30))},
        {"role": "assistant", "content": " ".join(f"b{i}" for i in range(30))},
        {"role": "user", "content": "please get_weather for Paris"},
    ]

    async def run() -> Any:
        async with _client(gateway.url) as client:
            agent = _agent(client, calls, ModelSettings(truncation="auto"))
            return await Runner.run(agent, history)

    result = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert calls == [""] and result.final_output == "sunny and warm"
    # each turn sent the instructions and the last user turn (with the tool's call and
    # output on the second): the earlier turn was dropped from both
    usage = [response.usage.input_tokens for response in result.raw_responses]
    assert usage == [4 + 4, 4 + 4 + 3]


def test_a_streamed_agent_run(gateway):
    calls: list[str] = []

    async def run() -> tuple[object, list[str]]:
        async with _client(gateway.url) as client:
            streamed = Runner.run_streamed(_agent(client, calls), "get_weather now")
            kinds = [event.type async for event in streamed.stream_events()]
            return streamed.final_output, kinds

    final, kinds = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert final == "sunny and warm" and calls == [""]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


@pytest.fixture(scope="module")
def vllm_front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_grpc: VllmProcess,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    """A gateway in front of vLLM's gRPC server, rendering the tools template."""
    model = ModelConfig(
        VLLM_TOOLS_MODEL,
        upstream="vllm-grpc",
        tokenizer=str(tools_tokenizer(vllm_model, tmp_path_factory.mktemp("agent-tokenizer"))),
        tool_call_parser="hermes",
        workers=(f"127.0.0.1:{vllm_grpc.port}",),
    )
    front = start_gateway(server_loop, make_config(workers, models=(model,)))
    yield front
    assert_nothing_left(front, None)
    front.stop()


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_agent_runs_its_loop_against_vllm(vllm_front: Gateway, stream: bool):
    cities: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "sunny and warm"

    async def run() -> Any:
        async with _client(vllm_front.url) as client:
            agent = Agent(
                name="forecaster",
                instructions="Answer with the weather.",
                tools=[get_weather],
                output_type=Forecast,
                model=OpenAIResponsesModel(VLLM_TOOLS_MODEL, client),
                model_settings=ModelSettings(
                    tool_choice="get_weather", temperature=0, max_tokens=48
                ),
            )
            if not stream:
                return await Runner.run(agent, "the weather in Paris?", max_turns=3)
            streamed = Runner.run_streamed(agent, "the weather in Paris?", max_turns=3)
            async for _ in streamed.stream_events():
                pass
            return streamed

    result = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert cities and cities[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert kinds[-1] == "message_output_item"
    assert result.final_output.sky in ("sunny", "rainy")
