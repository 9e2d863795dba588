"""Specs: the OpenAI Agents SDK, whose default model API is the Responses API, runs an
agent's loop to its final answer against the gateway: a turn that calls a function
tool, the SDK running the tool, a turn that answers from the tool's output; streamed
as well. The demo calls a tool whose name is a word of the last message and echoes
the last message otherwise (`gateway.worker.demo`)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD


@pytest.fixture(autouse=True)
def _no_tracing():
    # the SDK would export its traces to OpenAI's servers
    set_tracing_disabled(True)


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD
    )


def _agent(client: openai.AsyncOpenAI, calls: list[str]) -> Agent:
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
