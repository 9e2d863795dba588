"""A reasoning model's answer through the gateway against vLLM's own OpenAI server run
with `--reasoning-parser deepseek_r1` (its CPU build; the tiny model with `<think>` and
`</think>` in its vocabulary and a template whose answer begins in thought, as
DeepSeek-R1's): what the gateway relays is what vLLM says directly, streamed and whole,
reasoning and text alike, each in its field and order; and `include_reasoning: false`
reaches vLLM, which then sends the text alone. Greedy, so both answers are the same
tokens. After each test nothing is left in the gateway or in vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from gateway.config import ModelConfig
from tests.support.conformance import vllm_metric
from tests.support.fronts import gateway_over, grpc_model, openai_at
from tests.support.requests import user
from tests.support.servers import Gateway, assert_nothing_left
from tests.support.streams import said
from tests.support.tiny_model import THINKING, build_tiny_model
from tests.support.vllm import VllmProcess, start_grpc_server, start_http_server
from tests.support.waiting import HANG_GUARD, wait_until

#: Two vLLM servers start for the first test (about 20-30 s each on a busy 2-core machine):
#: past the default 60 s hang guard there once in CI.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-thinker"
#: The same model behind vLLM's gRPC server, its reasoning parsed by the gateway.
GRPC_MODEL = "tiny-thinker-grpc"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("thinker"), for_vllm=True, thinking=True)


@pytest.fixture(scope="module")
def thinker(thinking_model: Path) -> Iterator[VllmProcess]:
    extra = ("--reasoning-parser", "deepseek_r1")
    with start_http_server(thinking_model, thinking_model, name=MODEL, extra=extra) as server:
        yield server


@pytest.fixture(scope="module")
def thinker_grpc(thinking_model: Path) -> Iterator[VllmProcess]:
    with start_grpc_server(thinking_model, thinking_model) as server:
        yield server


@pytest.fixture(scope="module")
def front(
    server_loop, thinker: VllmProcess, thinker_grpc: VllmProcess, thinking_model: Path
) -> Iterator[Gateway]:
    url = f"http://127.0.0.1:{thinker.port}/v1"
    model = ModelConfig(MODEL, workers=(url,), upstream="openai")
    parsed_here = grpc_model(
        GRPC_MODEL, thinker_grpc, thinking_model, reasoning_parser="deepseek_r1"
    )
    with gateway_over(server_loop, (model, parsed_here)) as gw:
        yield gw


@pytest.fixture
def clients(front: Gateway, thinker: VllmProcess) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """The SDK through the gateway and straight to vLLM; after the test, nothing left."""
    with (
        openai_at(front.url + "/v1") as through,
        openai_at(f"http://127.0.0.1:{thinker.port}/v1") as direct,
    ):
        yield through, direct
    assert_nothing_left(front, None)
    running = lambda: vllm_metric(thinker.port, "vllm:num_requests_running")  # noqa: E731
    wait_until(lambda: running() == 0, "vLLM to be idle")


def whole(answer: Any) -> tuple[str | None, str | None]:
    """A whole answer's reasoning and text, empty as None: the gateway reads an answer
    from vLLM's stream, where an empty reasoning says nothing, and vLLM's own whole answer
    may say `""` for it."""
    message = answer.choices[0].message.model_dump()
    return message.get("reasoning") or None, message["content"] or None


def ask(client: openai.OpenAI, model: str = MODEL, **request: Any) -> Any:
    return client.chat.completions.create(model=model, messages=user("hi"), **{**GREEDY, **request})


@pytest.mark.parametrize(
    "bias",
    [
        None,  # the model never ends its thought: all of it reasoning
        0.9,  # `</think>` made likelier: whatever vLLM's parser makes of the answer
    ],
)
def test_the_gateway_relays_what_vllm_says(clients, thinking_model, bias):
    through, direct = clients
    extra = {} if bias is None else {"logit_bias": {str(end_of_thought(thinking_model)): bias}}
    answers = [whole(ask(client, **extra)) for client in (through, direct)]
    assert answers[0] == answers[1]
    assert answers[0] != (None, None)
    fields = {"stream": True, "stream_options": {"include_usage": True}, **extra}
    streams = [list(ask(client, **fields)) for client in (through, direct)]
    assert said(streams[0]) == said(streams[1])
    if bias is None:
        assert [field for field, _ in said(streams[0])] == ["reasoning"]
    else:
        assert said(streams[0])
    ours, theirs = (s[-1].usage for s in streams)
    assert ours.completion_tokens == theirs.completion_tokens
    assert ours.prompt_tokens == theirs.prompt_tokens


def test_include_reasoning_false_reaches_vllm(clients):
    through, direct = clients
    extra = {"extra_body": {"include_reasoning": False}}
    answers = [whole(ask(client, **extra)) for client in (through, direct)]
    assert answers[0] == answers[1]
    assert not answers[0][0]


def end_of_thought(model: Path) -> int:
    """`</think>`'s id in the model's vocabulary."""
    token = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(THINKING[1])
    assert token is not None
    return token


@pytest.mark.parametrize(("bias", "stop"), [(None, None), (0.9, None), (None, ["*3*"])])
def test_over_vllm_s_grpc_server_the_gateway_parses_as_vllm_s_server_does(
    clients, thinking_model, bias, stop
):
    # the gateway renders, tokenizes, detokenizes and cuts the reasoning itself
    # (`reasoning_parser: deepseek_r1`): what it says is what vLLM's HTTP server, run with
    # the same parser, says of the same greedy tokens
    through, direct = clients
    # 24 tokens: without a stop the answer ends in the first bytes of a character (three
    # tokens' text, each ending in one), which vLLM's server drops for good, as the gateway
    extra: dict[str, Any] = {}
    if bias is not None:
        extra["logit_bias"] = {str(end_of_thought(thinking_model)): bias}
    if stop is not None:  # in the thought: what comes before it is reasoning, all of it
        extra["stop"] = stop
    answers = ask(through, GRPC_MODEL, **extra), ask(direct, **extra)
    ours = whole(answers[0])
    assert ours == whole(answers[1])
    fields = {"stream": True, "stream_options": {"include_usage": True}, **extra}
    streams = list(ask(through, GRPC_MODEL, **fields)), list(ask(direct, **fields))
    assert said(streams[0]) == said(streams[1])
    # at a stop string too: the tokens up to the one that completed it, however many
    # tokens the gRPC server's messages held (it merges the engine's steps while busy)
    usages = [a.usage for a in answers] + [s[-1].usage for s in streams]
    assert len({(u.prompt_tokens, u.completion_tokens) for u in usages}) == 1
    hidden = whole(ask(through, GRPC_MODEL, extra_body={"include_reasoning": False}, **extra))
    assert hidden[0] is None and hidden[1] == ours[1]


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning_effort": "none"},  # vLLM: enable_thinking off for the template
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ],
)
def test_over_vllm_s_grpc_server_the_template_takes_its_variables_as_vllm_s_does(clients, extra):
    # the tiny thinking model's template opens the thought unless `enable_thinking` is
    # false: the gateway renders it so, as vLLM's server does for the same request
    through, direct = clients
    ours, theirs = (
        ask(through, GRPC_MODEL, max_tokens=20, **extra),
        ask(direct, max_tokens=20, **extra),
    )
    opened = ask(through, GRPC_MODEL, max_tokens=20)
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens == opened.usage.prompt_tokens - 1
    assert whole(ours) == whole(theirs)


@pytest.mark.parametrize("model", [MODEL, GRPC_MODEL])
def test_messages_thinking_disabled_turns_it_off_as_vllm_s_messages_server_does(
    clients, front, thinker, model
):
    # vLLM's own /v1/messages sends `thinking: disabled` to the template as effort "none"
    # (its `enable_thinking` off); the gateway does so for its OpenAI-compatible and its
    # vLLM gRPC upstreams alike: the same prompt, the same greedy answer
    request: dict[str, Any] = {
        "max_tokens": 20,
        "extra_body": {"temperature": 0},  # the SDK no longer names it
        "messages": user("hi"),
        "thinking": {"type": "disabled"},
    }
    direct_url = f"http://127.0.0.1:{thinker.port}"
    with (
        anthropic.Anthropic(base_url=front.url, api_key="x", timeout=HANG_GUARD) as through,
        anthropic.Anthropic(base_url=direct_url, api_key="x", timeout=HANG_GUARD) as direct,
    ):
        ours = through.messages.create(model=model, **request)
        theirs = direct.messages.create(model=MODEL, **request)
        thinking = through.messages.create(model=model, **{**request, "thinking": None})
    assert ours.usage.input_tokens == theirs.usage.input_tokens
    assert ours.usage.input_tokens == thinking.usage.input_tokens - 1  # the thought not opened
    # the answer's text alike; its thought (deepseek_r1's parser takes what comes before
    # `</think>` for one, opened or not) vLLM shows, and the gateway leaves out, as
    # `disabled` asks (vLLM's server shows thinking whatever `thinking` says)
    texts = ["".join(b.text for b in m.content if b.type == "text") for m in (ours, theirs)]
    assert texts[0] == texts[1]
    assert ours.usage.output_tokens == theirs.usage.output_tokens
    assert ours.stop_reason == theirs.stop_reason
    assert [b.type for b in ours.content] == ["text"]
