"""Specs: a prefill, the answer going on from the end of the conversation's last message
instead of a turn of its own: vLLM's chat parameters `continue_final_message` and
`add_generation_prompt`, and Anthropic's final assistant message, which is one. Through
the real gateway to a real worker on loopback (the demo engine, recording what it is
asked), to an OpenAI-compatible server (what it is sent), and the prompt the gateway
itself renders for `vllm-grpc` workers, against transformers' own rendering. The
transformers engine's: tests/test_tokenize_workers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from gateway.config import ModelConfig
from gateway.protocol.types import Event, GenerateRequest, Message
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from gateway.worker.demo import DemoEngine
from gateway.worker.server import WorkerServer
from tests.support.openai_server import OpenAIServer, keyed_plain
from tests.support.servers import (
    Gateway,
    ServerLoop,
    Workers,
    assert_nothing_left,
    make_config,
    start_gateway,
)
from tests.support.tiny_model import build_tokenizer
from tests.support.waiting import HANG_GUARD

MODEL = "prefilled"
HOSTED = "hosted-prefill"
KEY_ENV = "FURNACE_TEST_PREFILL_KEY"
ASKED = {"role": "user", "content": "write the list"}
PREFILL = {"role": "assistant", "content": "Here is the list:"}


class RecordingDemo(DemoEngine):
    """The demo engine, keeping the last request it generated for or counted."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.asked: GenerateRequest | None = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.asked = request
        async for event in super().generate(request):
            yield event

    async def count_tokens(self, request: GenerateRequest) -> int:
        self.asked = request
        return await super().count_tokens(request)


class Front:
    def __init__(self, gateway: Gateway, engine: RecordingDemo, hosted: OpenAIServer) -> None:
        self.gateway, self.engine, self.hosted = gateway, engine, hosted
        options: dict[str, Any] = {"api_key": "unused", "max_retries": 0, "timeout": HANG_GUARD}
        self.sdk = openai.OpenAI(base_url=gateway.url + "/v1", **options)
        self.claude = anthropic.Anthropic(base_url=gateway.url, **options)

    def asked(self) -> GenerateRequest:
        assert self.engine.asked is not None
        return self.engine.asked


@pytest.fixture(scope="module")
def front(server_loop: ServerLoop, workers: Workers) -> Iterator[Front]:
    engine = RecordingDemo()
    worker = WorkerServer(engine, "127.0.0.1", 0)
    server_loop.call(worker.start())
    with keyed_plain(server_loop, HOSTED, KEY_ENV, "1. bread") as hosted:
        models = (
            ModelConfig(MODEL, workers=(worker.address,)),
            ModelConfig(HOSTED, workers=(hosted.url,), upstream="openai", api_key_env=KEY_ENV),
        )
        gw = start_gateway(server_loop, make_config(workers, models=models))
        front = Front(gw, engine, hosted)
        with front.sdk, front.claude:
            yield front
        gw.stop()
    server_loop.call(worker.stop(0))


@pytest.fixture(autouse=True)
def _nothing_left(front: Front) -> Iterator[None]:
    yield
    assert_nothing_left(front.gateway, None)


def refusal(front: Front, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(front.gateway.url + path, json=body, timeout=HANG_GUARD)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error


# -- OpenAI's chat, with vLLM's parameters --------------------------------------------


def test_a_chat_goes_on_from_its_last_message_when_asked(front):
    answer = front.sdk.chat.completions.create(
        model=MODEL,
        messages=[ASKED, PREFILL],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    asked = front.asked()
    assert asked.continue_final_message and not asked.add_generation_prompt
    assert [m.role for m in asked.messages] == ["user", "assistant"]
    # the demo echoes the last message: the prefill's words, and only what follows it
    assert answer.choices[0].message.content == "Here is the list:"
    assert answer.choices[0].message.role == "assistant"


def test_a_streamed_prefill_and_the_default_end(front):
    stream = front.sdk.chat.completions.create(
        model=MODEL,
        messages=[ASKED, PREFILL],
        stream=True,
        extra_body={"continue_final_message": True},  # the generation prompt left out
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Here is the list:"
    assert front.asked().continue_final_message
    front.sdk.chat.completions.create(model=MODEL, messages=[ASKED])
    asked = front.asked()
    assert asked.add_generation_prompt and not asked.continue_final_message


def test_an_echoed_prefill_starts_the_answer(front):
    """vLLM's chat `echo`: the answer starts with the last message when it is the
    assistant's, so a prefill's answer reads whole; a user's last message is not echoed."""
    ends = {"continue_final_message": True}
    plain = front.sdk.chat.completions.create(
        model=MODEL, messages=[ASKED, PREFILL], extra_body=ends
    )
    goes_on = plain.choices[0].message.content
    echoed = front.sdk.chat.completions.create(
        model=MODEL, messages=[ASKED, PREFILL], extra_body={**ends, "echo": True}
    )
    assert echoed.choices[0].message.content == PREFILL["content"] + goes_on
    stream = front.sdk.chat.completions.create(
        model=MODEL, messages=[ASKED, PREFILL], stream=True, extra_body={**ends, "echo": True}
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == PREFILL["content"] + goes_on
    asked = front.sdk.chat.completions.create(
        model=MODEL, messages=[ASKED], extra_body={"echo": True}
    )
    assert asked.choices[0].message.content == "write the list"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (  # vLLM's refusal of both
            "/v1/chat/completions",
            {"continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ("/v1/chat/completions", {"continue_final_message": "yes"}, "continue_final_message"),
        ("/v1/chat/completions", {"add_generation_prompt": 0}, "add_generation_prompt"),
        ("/v1/chat/completions", {"echo": "yes"}, "echo"),
        # the demo renders no template: a chat without its generation prompt is not its
        ("/v1/chat/completions", {"add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"add_generation_prompt": False}, "add_generation_prompt"),
    ],
)
def test_chat_ends_a_model_cannot_make_are_refused_by_name(front, path, body, param):
    error = refusal(front, path, {"model": MODEL, "messages": [ASKED, PREFILL], **body})
    assert error["param"] == param, error


def test_a_completion_has_no_chat_to_continue(front):
    body = {"model": MODEL, "prompt": "a", "continue_final_message": True}
    assert refusal(front, "/v1/completions", body)["param"] == "continue_final_message"


def test_an_openai_server_is_sent_vllms_fields(front):
    front.sdk.chat.completions.create(
        model=HOSTED, messages=[ASKED, PREFILL], extra_body={"continue_final_message": True}
    )
    sent = front.hosted.last_body
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    front.sdk.chat.completions.create(
        model=HOSTED, messages=[ASKED, PREFILL], extra_body={"add_generation_prompt": False}
    )
    sent = front.hosted.last_body
    assert sent["add_generation_prompt"] is False and "continue_final_message" not in sent
    front.sdk.chat.completions.create(model=HOSTED, messages=[ASKED])
    sent = front.hosted.last_body
    assert "add_generation_prompt" not in sent and "continue_final_message" not in sent
    # the gateway writes the answer, so it echoes it (the server is not asked to)
    echoed = front.sdk.chat.completions.create(
        model=HOSTED,
        messages=[ASKED, PREFILL],
        extra_body={"continue_final_message": True, "echo": True},
    )
    assert echoed.choices[0].message.content == PREFILL["content"] + "1. bread"
    assert "echo" not in front.hosted.last_body


# -- Anthropic's final assistant message ----------------------------------------------


def test_a_final_assistant_message_is_continued(front):
    message = front.claude.messages.create(model=MODEL, max_tokens=16, messages=[ASKED, PREFILL])
    asked = front.asked()
    assert asked.continue_final_message and not asked.add_generation_prompt
    assert message.content[0].text == "Here is the list:"
    with front.claude.messages.stream(
        model=MODEL, max_tokens=16, messages=[ASKED, PREFILL]
    ) as stream:
        assert "".join(stream.text_stream) == "Here is the list:"
    # counted as the prompt the answer is made from
    counted = front.claude.messages.count_tokens(model=MODEL, messages=[ASKED, PREFILL])
    assert front.asked().continue_final_message and counted.input_tokens == 7


@pytest.mark.parametrize(
    ("last", "extra", "named"),
    [
        ({"role": "assistant", "content": "Here is "}, {}, "trailing whitespace"),
        (
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
            },
            {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
            "tool_use",
        ),
        (PREFILL, {"compaction": {"type": "summarize"}}, "compaction"),
    ],
)
def test_prefills_anthropic_refuses_are_refused(front, last, extra, named):
    with pytest.raises(anthropic.BadRequestError) as raised:
        front.claude.messages.create(
            model=MODEL, max_tokens=16, messages=[ASKED, last], extra_body=extra
        )
    assert named in raised.value.body["error"]["message"]


# -- the gateway's own rendering (vllm-grpc) ---------------------------------------------


def test_the_gateway_renders_a_prefill_as_transformers_does(tmp_path: Path):
    """The prompt the gateway makes for vLLM's gRPC server: the chat cut after the last
    message's text, or without the generation prompt, as transformers renders them."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    chat = (Message("user", ASKED["content"]), Message("assistant", PREFILL["content"]))
    messages = [ASKED, PREFILL]

    async def ids(request: GenerateRequest) -> list[int]:
        upstream = VllmGrpcUpstream("127.0.0.1:9", model="tiny", tokenizer=str(tmp_path))
        try:  # nothing listens there: the engine is never asked
            return (await upstream.tokenize(request, False, HANG_GUARD)).ids
        finally:
            await upstream.close()

    for template in (
        {"continue_final_message": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
    ):
        request = GenerateRequest("tiny", messages=chat, **template)
        wanted = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, **template
        )
        assert anyio.run(ids, request) == list(wanted), template
    opened = tokenizer.apply_chat_template(
        messages, tokenize=False, continue_final_message=True, add_generation_prompt=False
    )
    assert opened.endswith(PREFILL["content"])
