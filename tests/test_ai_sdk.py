"""Spec: the Vercel AI SDK (the real npm packages `ai`, `@ai-sdk/openai` and
`@ai-sdk/anthropic`, pinned in deploy/install-tools.sh, which puts them in .tools/ai-sdk),
the client of many product teams' TypeScript apps, runs against the gateway under uvicorn:
its OpenAI provider on the Responses API (`openai(model)`, its default) and on chat
completions (`openai.chat(model)`), its Anthropic provider on the Messages API. Each test
runs one case of tests/ai_sdk/cases.mjs in Node.js and reads the JSON it prints: the
answer and its usage, a stream, a tool the SDK runs over several steps, a zod schema's
object (`Output.object`, `generateObject`, `streamObject`), a reasoning model's loop whose
earlier steps go back (the Responses provider sends them as `item_reference`s to the
stored response's items), a conversation longer than the context (`truncation`) and a
refusal by name.

The model is the demo engine (its tokens are words): it echoes the last message's words,
calls each tool named in them with its schema's minimal input, and answers a schema's
minimal instance.
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ModelConfig
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from tests.support.agents import served
from tests.support.installed import ai_sdk
from tests.support.waiting import HANG_GUARD

CASES = Path(__file__).parent / "ai_sdk" / "cases.mjs"
#: The SDK's providers: the Responses API, chat completions, the Messages API.
PROVIDERS = ("responses", "chat", "anthropic")
#: What the demo answers for a tool's result, `{city, celsius}`: its words echoed.
ECHOED_RESULT = '{"city":"","celsius":20}'


@pytest.fixture
def run_case(gateway_with, serve_engines, caplog):
    """Runs one case of cases.mjs with one provider against a gateway of its own (the
    demo with `furnace-gateway demo`'s context, a token every 5 ms so a stream comes
    word by word); its JSON outcome."""
    caplog.set_level(logging.INFO, logger="furnace.access")
    node, folder = ai_sdk()
    (worker,) = serve_engines(DemoEngine(DEMO_MODEL, max_context=4096, token_delay=0.005))
    gw = gateway_with(models=(ModelConfig(DEMO_MODEL, workers=(worker.address,)),))

    def run(case: str, provider: str) -> dict[str, Any]:
        done = subprocess.run(
            [node, "--input-type=module", "-", case, provider, gw.url],
            input=CASES.read_text(),
            capture_output=True,
            text=True,
            cwd=folder,  # where `ai` and the providers resolve from
            timeout=HANG_GUARD,
        )
        assert done.returncode == 0 and done.stdout, done.stderr
        outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return outcome

    return run


def usage(inputs: int, outputs: int) -> dict[str, int]:
    return {"inputTokens": inputs, "outputTokens": outputs, "totalTokens": inputs + outputs}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_generate_text_answers_with_its_usage(run_case, provider, caplog):
    outcome = run_case("text", provider)
    assert outcome["text"] == "hello there"
    assert outcome["finishReason"] == "stop"
    assert outcome["usage"] == usage(2, 2)
    served(caplog, requests=1)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_stream_text_comes_word_by_word_with_its_usage(run_case, provider, caplog):
    outcome = run_case("stream", provider)
    assert outcome["chunks"] == ["one", " two", " three"]
    assert outcome["text"] == "one two three"
    assert outcome["finishReason"] == "stop"
    assert outcome["usage"] == usage(3, 3)  # the stream's usage (chat: `include_usage`)
    served(caplog, requests=1)


@pytest.mark.parametrize("case", ["tools", "streamTools"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_tool_runs_over_steps(run_case, provider, case, caplog):
    """`stopWhen: stepCountIs(3)`: the model calls `weather` (named in the prompt), the
    SDK runs its `execute` and sends the result back; the model echoes it, and the loop
    ends there, two steps. The usage is both steps': 3 + 4 words in (the prompt, then
    the prompt and the result), 2 + 1 tokens out (the call's arguments in two pieces,
    then the echo)."""
    outcome = run_case(case, provider)
    call, answer = outcome["steps"]
    assert call["finishReason"] == "tool-calls"
    assert call["toolCalls"] == [{"toolName": "weather", "input": {"city": ""}}]
    assert call["toolResults"] == [{"toolName": "weather", "output": {"city": "", "celsius": 20}}]
    assert outcome["executed"] == [{"city": ""}]
    assert answer["finishReason"] == "stop" and answer["toolCalls"] == []
    assert outcome["text"] == answer["text"] == ECHOED_RESULT
    assert outcome["usage"] == usage(7, 3)
    served(caplog, requests=2)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_zod_schema_gives_its_object(run_case, provider, caplog):
    """The schema's minimal instance, four ways: the Responses and chat providers ask
    for it as a `json_schema` format, the Messages provider (for a model it does not
    know) as a forced `json` tool."""
    outcome = run_case("object", provider)
    person = {"name": "", "age": 0, "tags": []}
    for way in ("generateText", "streamText", "generateObject", "streamObject"):
        assert outcome[way] == person, way
    assert outcome["partials"] >= 1
    assert outcome["usage"] == usage(2, 4)  # "a person"; the JSON in 4 pieces
    served(caplog, requests=4)


def test_a_reasoning_loop_sends_its_items_back_by_reference(run_case, caplog):
    """With `store` (the Responses provider's default), the SDK sends an earlier step's
    reasoning item back as an `item_reference`, and a later turn the answer's message
    too: the gateway reads each from the stored response that holds it. The demo
    thinks the last word it echoes."""
    outcome = run_case("reasoning", "responses")
    assert [step["finishReason"] for step in outcome["steps"]] == ["tool-calls", "stop"]
    assert outcome["reasoning"] == ["Paris", ECHOED_RESULT]
    assert outcome["text"] == ECHOED_RESULT
    assert outcome["second"] == {"text": "and tomorrow", "reasoning": "tomorrow"}
    first, second, turn = outcome["sent"]
    assert first["items"] == ["message"]
    assert second["items"] == ["message", "item_reference", "function_call", "function_call_output"]
    assert turn["items"] == ["message", "item_reference", "item_reference", "message"]
    served(caplog, requests=3)


def test_a_thinking_loop_sends_its_thinking_back(run_case, caplog):
    """Adaptive thinking with an effort (`output_config.effort`): each step's `thinking`
    block goes back with its signature, and is served."""
    outcome = run_case("reasoning", "anthropic")
    assert outcome["reasoning"] == ["Paris", ECHOED_RESULT]
    assert outcome["second"] == {"text": "and tomorrow", "reasoning": "tomorrow"}
    served(caplog, requests=3)


def test_truncation_answers_a_conversation_longer_than_the_context(run_case, caplog):
    """`providerOptions.openai.truncation: "auto"`: the 5,002 words of the conversation
    pass the demo's 4,096; its earlier turns are dropped, the last user turn answered."""
    outcome = run_case("truncation", "responses")
    assert outcome["truncation"] == ["auto"]
    assert outcome["text"] == "and now" and outcome["usage"] == usage(2, 2)
    served(caplog, requests=1)


@pytest.mark.parametrize(
    ("provider", "message"),
    [
        ("responses", "'text.verbosity' is not supported by this gateway."),
        ("chat", "'verbosity' is not supported by this gateway."),
        # the demo's workers take an effort, not a budget of thinking tokens
        ("anthropic", "The model `furnace-demo` does not support 'thinking.budget_tokens'."),
    ],
)
def test_what_is_not_served_is_refused_by_name(run_case, provider, message):
    """A provider option the gateway cannot serve (`textVerbosity`; a thinking budget for
    a model whose workers have none) is the gateway's 400, naming it, which the SDK
    shows as it came and does not retry."""
    outcome = run_case("refused", provider)
    assert outcome["refused"] is True
    assert outcome["statusCode"] == 400
    assert outcome["message"] == message
    assert outcome["retryable"] is False
