"""vLLM's reasoning parameters on the gateway's own workers: the worker protocol carries
them (`ReasoningOptions`) to engines that list them, and the engines' reasoning comes
back as `Reasoning` events. The demo takes an effort and thinks by it (its module's
rules: the last words of the prompt, one for low, two for medium, four for high), so
Claude Code's `output_config.effort`, chat's `reasoning_effort` and the Responses API's
`reasoning.effort` are served by the model the README starts; an engine that does not
list a parameter still refuses it by name. Real gateway, real gRPC workers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import ModelConfig
from gateway.protocol import features
from gateway.protocol.types import Event, GenerateRequest, ReasoningParams
from gateway.worker.demo import DemoEngine
from tests.support.requests import user
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.streams import said
from tests.support.waiting import HANG_GUARD

PROMPT = "one two three four five"


class RecordingEngine(DemoEngine):
    """The demo, listing every reasoning parameter: keeps each request's `reasoning`."""

    features = DemoEngine.features | features.REASONING

    def __init__(self) -> None:
        super().__init__("furnace-recording")
        self.seen: list[ReasoningParams | None] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.seen.append(request.reasoning)
        async for event in super().generate(request):
            yield event


class PlainEngine(DemoEngine):
    """The demo without `reasoning_effort`: an engine whose template takes no effort."""

    features = DemoEngine.features - {features.REASONING_EFFORT}

    def __init__(self) -> None:
        super().__init__("furnace-plain")


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=HANG_GUARD)


def claude(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=HANG_GUARD)


def test_every_reasoning_parameter_crosses_the_protocol(gateway_with, serve_engines):
    engine = RecordingEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig(engine.model, workers=(worker.address,)),))
    chat: dict[str, Any] = {"model": engine.model, "messages": user(PROMPT)}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for extra in (
            {"reasoning_effort": "medium"},
            {
                "reasoning_effort": "none",
                "include_reasoning": False,
                "chat_template_kwargs": {"enable_thinking": True, "depth": 2},
                "thinking_token_budget": 7,
            },
            {"thinking_token_budget": 0},
            {},
        ):
            served = http.post("/v1/chat/completions", json={**chat, **extra})
            assert served.status_code == 200, served.text
        messages = {"model": engine.model, "max_tokens": 2048, "messages": user(PROMPT)}
        for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}):
            served = http.post("/v1/messages", json={**messages, "thinking": thinking})
            assert served.status_code == 200, served.text
    assert engine.seen == [
        ReasoningParams(effort="medium"),
        ReasoningParams("none", False, '{"enable_thinking":true,"depth":2}', 7),
        ReasoningParams(budget=0),
        None,
        ReasoningParams(off=True),  # a hint: the demo's rules read it as no thought
        ReasoningParams(budget=1024),
    ]


def test_an_engine_that_takes_no_effort_refuses_it_by_name(gateway_with, serve_engines):
    engine = PlainEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig(engine.model, workers=(worker.address,)),))
    model = engine.model
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for route, body, param in [
            (
                "/v1/chat/completions",
                {"model": model, "messages": user("hi"), "reasoning_effort": "high"},
                "reasoning_effort",
            ),
            (
                "/v1/responses",
                {"model": model, "input": "hi", "reasoning": {"effort": "low"}},
                "reasoning.effort",
            ),
        ]:
            refused = http.post(route, json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param
        effort = {"effort": "high"}
        body = {"model": model, "max_tokens": 8, "messages": user("hi"), "output_config": effort}
        refused = http.post("/v1/messages", json=body)
        assert refused.status_code == 400, refused.text
        assert "'output_config.effort'" in refused.json()["error"]["message"]
        # a completion has no chat template to take one, whoever serves it
        completion = {"model": model, "prompt": "hi", "reasoning_effort": "high"}
        refused = http.post("/v1/completions", json=completion)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "reasoning_effort"
        # thinking turned off asks nothing of an engine that takes no effort
        off = {**body, "output_config": {}, "thinking": {"type": "disabled"}}
        assert http.post("/v1/messages", json=off).status_code == 200
    assert engine.refused == 0  # refused by the gateway, from what the worker lists


@pytest.mark.parametrize(
    ("effort", "thought"),
    [
        ("minimal", "five"),
        ("low", "five"),
        ("medium", "four five"),
        ("high", "two three four five"),
        ("max", "two three four five"),
    ],
)
def test_the_demo_thinks_by_the_effort_in_chat(gateway, effort, thought):
    with sdk(gateway) as client:
        whole = client.chat.completions.create(
            model=DEMO_MODEL, messages=user(PROMPT), reasoning_effort=effort
        )
        chunks = list(
            client.chat.completions.create(
                model=DEMO_MODEL,
                messages=user(PROMPT),
                reasoning_effort=effort,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    message = whole.choices[0].message
    assert message.reasoning == thought  # type: ignore[attr-defined]
    assert message.content == PROMPT
    tokens = len(thought.split()) + len(PROMPT.split())
    assert whole.usage is not None and whole.usage.completion_tokens == tokens
    assert said(chunks) == [("reasoning", thought), ("content", PROMPT)]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens
    details = chunks[-1].usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == len(thought.split())


def test_the_demo_s_thought_counts_against_max_tokens_and_none_thinks_nothing(client):
    body = {"model": DEMO_MODEL, "messages": user(PROMPT), "reasoning_effort": "high"}
    cut = client.post("/v1/chat/completions", json={**body, "max_tokens": 3}).json()
    choice = cut["choices"][0]
    assert choice["message"]["reasoning"] == "two three four"
    assert not choice["message"]["content"] and choice["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 3
    for extra in ({"reasoning_effort": "none"}, {}):
        asked = {"model": DEMO_MODEL, "messages": user(PROMPT), **extra}
        plain = client.post("/v1/chat/completions", json=asked).json()
        assert plain["usage"]["completion_tokens"] == len(PROMPT.split())
        message = plain["choices"][0]["message"]
        assert message["content"] == PROMPT and not message.get("reasoning")


def test_the_demo_s_thought_is_a_reasoning_item_in_responses(gateway):
    with sdk(gateway) as client:
        request: dict[str, Any] = {
            "model": DEMO_MODEL,
            "input": PROMPT,
            "reasoning": {"effort": "medium"},
        }
        whole = client.responses.create(**request)
        with client.responses.stream(**request) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
        plain = client.responses.create(model=DEMO_MODEL, input=PROMPT)
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.content is not None and reasoning.content[0].text == "four five"
        assert response.output_text == PROMPT
        assert response.reasoning is not None and response.reasoning.effort == "medium"
        assert response.usage is not None and response.usage.output_tokens == 7
        assert response.usage.output_tokens_details.reasoning_tokens == 2
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "four five"
    assert [item.type for item in plain.output] == ["message"]


def test_the_demo_s_thought_is_a_thinking_block_in_messages(gateway):
    request: dict[str, Any] = {
        "model": DEMO_MODEL,
        "max_tokens": 64,
        "messages": user(PROMPT),
        "output_config": {"effort": "high"},  # what Claude Code sends on every request
    }
    with claude(gateway) as client:
        whole = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
        hidden = client.messages.create(
            **request, thinking={"type": "adaptive", "display": "omitted"}
        )
        disabled = client.messages.create(**request, thinking={"type": "disabled"})
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking, text = message.content
        assert thinking.thinking == "two three four five"  # type: ignore[union-attr]
        assert text.text == PROMPT  # type: ignore[union-attr]
        assert message.usage.output_tokens == 9
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[:5] == ["thinking_delta"] * 4 + ["signature_delta"]
    # thought, its text left out of its block (as Anthropic's API answers `omitted`, the
    # block and its signature kept to be sent back): its tokens are still the answer's
    assert [block.type for block in hidden.content] == ["thinking", "text"]
    omitted = hidden.content[0]
    assert omitted.thinking == "" and omitted.signature  # type: ignore[union-attr]
    assert hidden.usage.output_tokens == 9
    # turned off: no thought at all
    assert [block.type for block in disabled.content] == ["text"]
    assert disabled.usage.output_tokens == 5
