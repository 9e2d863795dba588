"""Counting a prompt's tokens (Anthropic's count_tokens) through each upstream: our
workers' `CountTokens` rpc (the demo counts words; an engine that cannot count
refuses naming `model`), an OpenAI-compatible server's `/tokenize` (mocked: vLLM's
answer; a server without the route is a 400 naming `model`), and `vllm-grpc`'s own
tokenizer in the gateway, which asks the engine nothing. The route itself:
tests/test_anthropic_api.py and tests/test_anthropic_conformance.py."""

from __future__ import annotations

import anyio
import httpx
import orjson
import pytest
import respx

from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest, Message, Tool
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.upstreams.openai_http import OpenAIHttpUpstream
from gateway.upstreams.openai_http.translate import tokens_counted
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from tests.support.script_engine import ScriptEngine
from tests.support.servers import DEMO_MODEL
from tests.support.tiny_model import build_tokenizer
from tests.support.waiting import HANG_GUARD

CHAT = GenerateRequest(
    DEMO_MODEL,
    messages=(Message("system", "be brief"), Message("user", "three words here")),
    tools=(Tool("get_weather", "the weather", '{"type": "object"}'),),
)


def count(server_loop, address: str, request: GenerateRequest) -> int:
    async def ask() -> int:
        upstream = FurnaceGrpcUpstream(address)
        try:
            return await upstream.count_tokens(request, HANG_GUARD)
        finally:
            await upstream.close()

    return server_loop.call(ask())


def test_a_worker_counts_with_its_engine(server_loop, workers):
    assert count(server_loop, workers.demo.address, CHAT) == 5  # the demo's words
    prompt = GenerateRequest(DEMO_MODEL, prompt="one two three four")
    assert count(server_loop, workers.demo.address, prompt) == 4
    with pytest.raises(errors.ModelNotFound):
        count(server_loop, workers.demo.address, GenerateRequest("elsewhere", prompt="a"))


def test_an_engine_that_cannot_count_refuses_naming_model(server_loop, serve_engines):
    (worker,) = serve_engines(ScriptEngine([]))
    with pytest.raises(errors.Invalid) as raised:
        count(server_loop, worker.address, GenerateRequest("script-engine", prompt="a"))
    assert raised.value.param == "model"


async def count_over_http() -> int:
    async with httpx.AsyncClient() as http:
        upstream = OpenAIHttpUpstream("http://upstream.test/v1", http, raw_http=False)
        return await upstream.count_tokens(CHAT, HANG_GUARD)


@respx.mock
def test_an_openai_server_counts_with_its_tokenize_route():
    route = respx.post("http://upstream.test/tokenize").respond(
        200, json={"count": 17, "max_model_len": 1024, "tokens": [1] * 17}
    )
    assert anyio.run(count_over_http) == 17
    sent = orjson.loads(route.calls.last.request.content)
    assert sent["model"] == DEMO_MODEL and sent["add_generation_prompt"] is True
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert set(sent) == {"model", "messages", "tools", "add_generation_prompt"}


@respx.mock
@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (404, {"detail": "Not Found"}, errors.Invalid),
        (400, {"error": {"message": "bad", "type": "BadRequestError"}}, errors.Invalid),
        (200, {"no": "count"}, errors.Failed),
        (503, {"error": {"message": "down"}}, errors.Unavailable),
    ],
)
def test_an_openai_server_that_cannot_count_is_refused_clearly(status, body, error):
    respx.post("http://upstream.test/tokenize").respond(status, json=body)
    with pytest.raises(error) as raised:
        anyio.run(count_over_http)
    if status == 404:
        assert raised.value.param == "model" and "cannot count" in raised.value.message


def test_an_upstream_that_cannot_count_says_so_by_its_class(server_loop, serve_engines):
    """`CannotCount`, which the routes that count to edit a prompt answer themselves: a
    worker's engine without a tokenizer, a server without `/tokenize` (404, 405) or
    refusing it naming `model`; any other refusal is not it."""
    (worker,) = serve_engines(ScriptEngine([]))
    with pytest.raises(errors.CannotCount) as raised:
        count(server_loop, worker.address, GenerateRequest("script-engine", prompt="a"))
    assert raised.value.param == "model" and "does not count tokens" in raised.value.message
    naming_model = orjson.dumps({"error": {"message": "no", "param": "model"}})
    for status, body in [(404, b"Not Found"), (405, b""), (400, naming_model)]:
        with pytest.raises(errors.CannotCount) as raised:
            tokens_counted(status, body)
        assert raised.value.param == "model"
    naming_other = orjson.dumps({"error": {"message": "no", "param": "messages"}})
    with pytest.raises(errors.Invalid) as refused:
        tokens_counted(400, naming_other)
    assert type(refused.value) is errors.Invalid and refused.value.param == "messages"


def test_vllm_grpc_counts_with_the_gateways_tokenizer(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    plain = GenerateRequest("tiny", prompt="hello world")

    async def counts() -> tuple[int, int, VllmGrpcUpstream]:
        # nothing listens there: the count never reaches the engine
        upstream = VllmGrpcUpstream("127.0.0.1:9", model="tiny", tokenizer=str(tmp_path))
        try:
            chat = await upstream.count_tokens(CHAT, HANG_GUARD)
            return chat, await upstream.count_tokens(plain, HANG_GUARD), upstream
        finally:
            await upstream.close()

    chat, text, upstream = anyio.run(counts)
    tokenizer = upstream.tokenizer
    assert chat == len(tokenizer.prompt_ids(None, CHAT.messages, CHAT.tools)) > 5
    assert text == len(tokenizer.prompt_ids("hello world", None))
