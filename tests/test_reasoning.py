"""A reasoning model's reasoning through an `upstream: openai` model: vLLM's server, run
with `--reasoning-parser`, sends the text the model thinks before its answer apart from
the answer (the delta's `reasoning`; `reasoning_content` before vLLM renamed it), and
chat clients get it as vLLM's own server gives it: streamed in order before the answer's
text, whole in the message's `reasoning`, its tokens in the usage. Read with the official
openai SDK, from our small OpenAI-compatible server (tests/support/openai_server.py), over
plain HTTP (the gateway's own connections) and over TLS (httpx).

The Responses API shows it as a `reasoning` item before the message, and the Messages API
as a `thinking` block before the text, as vLLM's own servers do. An assistant turn's
reasoning, sent back in a conversation, reaches the model's template.

vLLM's reasoning parameters (`reasoning_effort`, `include_reasoning`, `chat_template_kwargs`)
are checked and sent on to such a model's servers; a model whose workers do not take them
(the demo takes only `reasoning_effort`: tests/test_reasoning_workers.py) refuses them by
name, as it refuses any feature its workers lack."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.config import ModelConfig
from tests.support.certs import CertificateAuthority
from tests.support.openai_server import OpenAIServer
from tests.support.requests import user
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.streams import noted_writes, said
from tests.support.waiting import HANG_GUARD

MODEL = "thinker"
THOUGHTS = ["The user ", "says hi; ", "I greet back."]


@pytest.fixture(params=["http", "https"])
def thinker(
    request, server_loop, tmp_path, gateway_with, workers
) -> Iterator[tuple[OpenAIServer, Gateway]]:
    """The upstream, thinking before its reply, and a gateway in front of it."""
    key = "sk-" + secrets.token_hex(8)
    ca = CertificateAuthority(tmp_path, "upstream-ca") if request.param == "https" else None
    cert = None if ca is None else ca.issue("upstream", ips=("127.0.0.1",))
    server = OpenAIServer(MODEL, key, cert)
    server.reasoning = list(THOUGHTS)
    server_loop.call(server.start())
    credentials = {} if ca is None else {"ca_file": ca.ca_file}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKER_KEY", key)
        model = ModelConfig(
            MODEL,
            workers=(server.url,),
            upstream="openai",
            api_key_env="THINKER_KEY",
            **credentials,
        )
        demo = ModelConfig(DEMO_MODEL, workers=(workers.demo.address,))
        gw = gateway_with(models=(model, demo))
        yield server, gw
    server_loop.call(server.stop())


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=HANG_GUARD)


def streamed_and_whole(gw: Gateway) -> tuple[list[Any], Any]:
    """A chat's stream's chunks and its whole answer, for the same request."""
    with sdk(gw) as client:
        chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), stream=True))
        return chunks, client.chat.completions.create(model=MODEL, messages=user("hi"))


def test_a_stream_carries_the_reasoning_before_the_answer(thinker):
    _, gw = thinker
    with sdk(gw) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=user("hi"),
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    assert said(chunks) == [("reasoning", "".join(THOUGHTS)), ("content", "hello")]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(THOUGHTS)  # the upstream's count
    # of them, the reasoning's (here the chunks that held some), as vLLM's server says
    details = chunks[-1].usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == len(THOUGHTS)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"


def test_paced_reasoning_is_written_in_the_callback_that_brought_it(thinker, monkeypatch):
    # an engine's steps apart: each piece comes while the edge waits, and the pump's sink
    # writes it (edge/openai/generation.py `_Sink`), reasoning as text, where the upstream's
    # call pushes what it reads (the gateway's own connections: plain HTTP)
    server, gw = thinker
    server.pace = 0.03
    written = noted_writes(monkeypatch)
    with sdk(gw) as client:
        chunks = list(client.chat.completions.create(model=MODEL, messages=user("hi"), stream=True))
    assert said(chunks) == [("reasoning", "".join(THOUGHTS)), ("content", "hello")]
    if server.url.startswith("http:"):
        assert sum(b'"reasoning":' in body for body in written) >= 2


def test_a_whole_answer_holds_its_reasoning_in_the_message(thinker):
    _, gw = thinker
    with sdk(gw) as client:
        answer = client.chat.completions.create(model=MODEL, messages=user("hi"))
    message = answer.choices[0].message
    assert message.content == "hello"
    assert message.model_dump()["reasoning"] == "".join(THOUGHTS)
    assert answer.usage is not None and answer.usage.completion_tokens == len(THOUGHTS)
    details = answer.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == len(THOUGHTS)


def test_an_older_server_s_reasoning_content_is_read_and_sent_as_reasoning(thinker):
    server, gw = thinker
    server.reasoning_field = "reasoning_content"
    chunks, answer = streamed_and_whole(gw)
    assert said(chunks) == [("reasoning", "".join(THOUGHTS)), ("content", "hello")]
    assert answer.choices[0].message.model_dump()["reasoning"] == "".join(THOUGHTS)


def test_an_answer_that_is_all_reasoning_is_sent_whole(thinker):
    # cut before the model stopped thinking (its max_tokens): reasoning and no text
    server, gw = thinker
    server.reply = ""
    chunks, answer = streamed_and_whole(gw)
    assert said(chunks) == [("reasoning", "".join(THOUGHTS))]
    assert answer.choices[0].message.content is None  # as vLLM's server says it
    assert answer.choices[0].message.model_dump()["reasoning"] == "".join(THOUGHTS)


def test_other_shapes_of_chat_carry_it_too(thinker):
    # with tools: not the one-choice plain path, but the events path
    _, gw = thinker
    with sdk(gw) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=user("hi"), tools=[_tool()], stream=True
            )
        )
        whole = client.chat.completions.create(model=MODEL, messages=user("hi"), tools=[_tool()])
    assert said(chunks) == [("reasoning", "".join(THOUGHTS)), ("content", "hello")]
    assert whole.choices[0].message.model_dump()["reasoning"] == "".join(THOUGHTS)


def _tool() -> Any:
    parameters = {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": "noop", "parameters": parameters}}


def test_responses_show_it_as_a_reasoning_item_before_the_message(thinker):
    _, gw = thinker
    thought = "".join(THOUGHTS)
    with sdk(gw) as client:
        whole = client.responses.create(model=MODEL, input="hi")
        with client.responses.stream(model=MODEL, input="hi") as stream:
            events = list(stream)
            streamed = stream.get_final_response()
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        reasoning = response.output[0]
        assert reasoning.content is not None and reasoning.content[0].text == thought
        assert reasoning.summary == [] and reasoning.status == "completed"
        assert response.output_text == "hello"
        assert response.usage is not None and response.usage.output_tokens == len(THOUGHTS)
        assert response.usage.output_tokens_details.reasoning_tokens == len(THOUGHTS)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_conversation_gives_the_reasoning_back_to_the_model(thinker):
    # stored (previous_response_id), or sent back as items: the assistant turn's reasoning
    # goes with it, as vLLM's templates of models that think between turns read it
    server, gw = thinker
    thought = "".join(THOUGHTS)
    with sdk(gw) as client:
        first = client.responses.create(model=MODEL, input="hi")
        client.responses.create(model=MODEL, input="and?", previous_response_id=first.id)
        stored = server.last_body["messages"]
        items = [item.model_dump(exclude_none=True) for item in first.output]
        turns = [{"role": "user", "content": "hi"}, *items, {"role": "user", "content": "and?"}]
        client.responses.create(model=MODEL, input=turns)  # type: ignore[arg-type]
        sent = server.last_body["messages"]
    for messages in (stored, sent):
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["reasoning"] == thought and messages[1]["content"] == "hello"


def test_responses_reasoning_effort_reaches_the_server(thinker):
    server, gw = thinker
    with sdk(gw) as client:
        response = client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"})
    assert server.last_body["reasoning_effort"] == "high"
    assert response.reasoning is not None and response.reasoning.effort == "high"
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        summary = {"model": MODEL, "input": "hi", "reasoning": {"summary": "brief"}}
        bad = {"model": MODEL, "input": "hi", "reasoning": {"effort": "extreme"}}
        item = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
        encrypted = {"model": MODEL, "input": [item, {"role": "user", "content": "hi"}]}
        for body, param in [
            (summary, "reasoning.summary"),
            (bad, "reasoning.effort"),
            (encrypted, "input[0].encrypted_content"),
        ]:
            refused = http.post("/v1/responses", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param


def anthropic_sdk(gw: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=HANG_GUARD)


def test_messages_show_it_as_a_thinking_block_before_the_text(thinker):
    # as vLLM's own Messages server does: thinking blocks whether or not `thinking` asked
    _, gw = thinker
    thought = "".join(THOUGHTS)
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 2048, "messages": user("hi")}
    with anthropic_sdk(gw) as client:
        whole = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            events = list(stream)
            streamed = stream.get_final_message()
        enabled = client.messages.create(
            **request, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    for message in (whole, streamed, enabled):
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking, text = message.content
        assert thinking.thinking == thought and thinking.signature  # type: ignore[union-attr]
        assert text.text == "hello"  # type: ignore[union-attr]
        assert message.usage.output_tokens == len(THOUGHTS)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas[: len(THOUGHTS)] == ["thinking_delta"] * len(THOUGHTS)
    assert deltas[len(THOUGHTS)] == "signature_delta"  # the thinking block's last


def test_messages_thinking_budget_and_display(thinker):
    server, gw = thinker
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 4096, "messages": user("hi")}
    with anthropic_sdk(gw) as client:
        client.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 2000})
        assert server.last_body["thinking_token_budget"] == 2000
        for thinking, effort, blocks in (
            # turned off, as vLLM's Messages server does
            ({"type": "disabled"}, "none", ["text"]),
            # thought, its text left out of its block, as Anthropic's API answers it
            ({"type": "adaptive", "display": "omitted"}, None, ["thinking", "text"]),
        ):
            hidden = client.messages.create(**request, thinking=thinking)  # type: ignore[arg-type]
            assert "thinking_token_budget" not in server.last_body
            assert server.last_body.get("reasoning_effort") == effort
            assert [block.type for block in hidden.content] == blocks
            assert all(getattr(b, "thinking", "") == "" for b in hidden.content)
            assert hidden.usage.output_tokens == len(THOUGHTS)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for thinking, param in [
            ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"),  # >= max
            ({"type": "enabled", "budget_tokens": 100}, "thinking.budget_tokens"),
            ({"type": "enabled"}, "thinking.budget_tokens"),
            ({"type": "adaptive", "display": "full"}, "thinking.display"),
            ({"type": "sometimes"}, "thinking.type"),
        ]:
            refused = http.post("/v1/messages", json={**request, "thinking": thinking})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["message"].startswith(param + ":")
        # workers that take no budget (the gateway's own) refuse it; disabled asks nothing
        demo = {**request, "model": DEMO_MODEL}
        budget = {"type": "enabled", "budget_tokens": 1024}
        refused = http.post("/v1/messages", json={**demo, "thinking": budget})
        assert refused.status_code == 400, refused.text
        # named as this API names it, not as the check shared with chat does
        assert "'thinking.budget_tokens'" in refused.json()["error"]["message"]
        assert "thinking_token_budget" not in refused.json()["error"]["message"]
        disabled = {**demo, "max_tokens": 8, "thinking": {"type": "disabled"}}
        shown = http.post("/v1/messages", json=disabled)
        assert shown.status_code == 200, shown.text


def test_messages_output_config_reaches_the_server_as_vllm_s_messages_server_sends_it(
    thinker,
):
    server, gw = thinker
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    with anthropic_sdk(gw) as client:
        client.messages.create(
            model=MODEL,
            max_tokens=4096,
            messages=user("hi"),
            thinking={"type": "enabled", "budget_tokens": 2000},
            output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}},
        )
    sent = server.last_body
    assert sent["reasoning_effort"] == "high" and sent["thinking_token_budget"] == 2000
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"] == schema
    assert sent["response_format"]["json_schema"]["strict"] is True


def test_messages_give_thinking_blocks_back_to_the_model(thinker):
    server, gw = thinker
    with anthropic_sdk(gw) as client:
        first = client.messages.create(model=MODEL, max_tokens=64, messages=user("hi"))
        history: list[Any] = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": "and?"},
        ]
        client.messages.create(model=MODEL, max_tokens=64, messages=history)
    sent = server.last_body["messages"]
    assert sent[1]["reasoning"] == "".join(THOUGHTS) and sent[1]["content"] == "hello"
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgB"}
    history[1] = {"role": "assistant", "content": [redacted, {"type": "text", "text": "x"}]}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        body = {"model": MODEL, "max_tokens": 64, "messages": history}
        refused = http.post("/v1/messages", json=body)
    assert refused.status_code == 400, refused.text
    assert "redacted" in refused.text.lower()


def test_a_chat_gives_an_assistant_s_reasoning_back_to_the_model(thinker):
    server, gw = thinker
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning": "greet"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "so", "reasoning_content": "older name"},
        {"role": "user", "content": "ok"},
    ]
    with sdk(gw) as client:
        client.chat.completions.create(model=MODEL, messages=history)  # type: ignore[arg-type]
    sent = server.last_body["messages"]
    assert [m.get("reasoning") for m in sent] == [None, "greet", None, "older name", None]
    history[1]["reasoning"] = 7
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages[1].reasoning"


def test_the_reasoning_parameters_reach_the_server(thinker):
    server, gw = thinker
    kwargs = {"enable_thinking": False, "budget": {"steps": [1, 2]}}
    extra = {
        "include_reasoning": False,
        "chat_template_kwargs": kwargs,
        "thinking_token_budget": 64,
    }
    with sdk(gw) as client:
        client.chat.completions.create(
            model=MODEL, messages=user("hi"), reasoning_effort="low", extra_body=extra
        )
    sent = server.last_body
    assert sent["reasoning_effort"] == "low"
    assert sent["include_reasoning"] is False
    assert sent["chat_template_kwargs"] == kwargs
    assert sent["thinking_token_budget"] == 64
    with sdk(gw) as client:
        client.chat.completions.create(model=MODEL, messages=user("hi"))
    sent_now = set(server.last_body)
    assert not sent_now & {"reasoning_effort", "include_reasoning", "chat_template_kwargs"}
    assert "thinking_token_budget" not in sent_now


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "extreme"),
        ("reasoning_effort", 3),
        ("include_reasoning", "no"),
        ("chat_template_kwargs", ["enable_thinking"]),
        ("chat_template_kwargs", {"text": "x" * 20_000}),
        ("thinking_token_budget", -2),
        ("thinking_token_budget", 1.5),
    ],
)
def test_a_bad_reasoning_parameter_is_refused_by_name(thinker, field, value):
    _, gw = thinker
    body = {"model": MODEL, "messages": user("hi"), field: value}
    response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("include_reasoning", False),
        ("chat_template_kwargs", {"enable_thinking": True}),
        ("thinking_token_budget", 100),
    ],
)
def test_workers_that_do_not_take_them_refuse_them_by_name(thinker, field, value):
    _, gw = thinker
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        chat = {"model": DEMO_MODEL, "messages": user("hi"), field: value}
        refused = http.post("/v1/chat/completions", json=chat)
        completion = {"model": MODEL, "prompt": "hi", field: value}
        not_a_chat = http.post("/v1/completions", json=completion)
        plain = {"model": DEMO_MODEL, "messages": user("hi"), "include_reasoning": True}
        served = http.post("/v1/chat/completions", json=plain)
    for response in (refused, not_a_chat):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
    assert served.status_code == 200, served.text
