"""Specs: `/tokenize` and `/detokenize` (and under `/v1`) against the real gateway with
the demo workers (whose engine's tokens are the prompt's words, as it counts them): the
answers' shape, the ids the count would count, a round trip through `/detokenize`; every
refusal naming its parameter; a model whose workers do not show tokens (the scripted
first-version worker) is a 400 naming `model`. The OpenAI-compatible upstream's side of
vLLM's routes (what is sent, answers read and refused, bounds) with respx; vLLM's own
server, and the gateway's own tokenizer, in tests/test_tokenize_vllm.py."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson
import pytest
import respx

from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest, Message, Tool
from gateway.upstreams.openai_http import OpenAIHttpUpstream
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "three words here"}]


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(path, json=body)


def tokenized(client: httpx.Client, path: str = "/tokenize", **body: Any) -> dict[str, Any]:
    reply = post(client, path, {"model": DEMO_MODEL, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def refused(client: httpx.Client, path: str, body: dict[str, Any], status: int = 400) -> dict:
    reply = post(client, path, body)
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_a_chat_and_a_prompt_are_tokenized_as_the_model_counts_them(client, prefix):
    chat = tokenized(client, prefix + "/tokenize", messages=CHAT)
    assert set(chat) == {"count", "max_model_len", "tokens", "token_strs"}
    assert chat["count"] == len(chat["tokens"]) == 5  # the demo's words, as it counts them
    assert chat["token_strs"] is None and chat["max_model_len"] > 0
    counted = post(
        client, "/v1/messages/count_tokens", {"model": DEMO_MODEL, "system": "be brief",
        "messages": [{"role": "user", "content": "three words here"}]},
    )  # fmt: skip
    assert counted.json()["input_tokens"] == chat["count"]
    text = tokenized(client, prefix + "/tokenize", prompt="one two three", return_token_strs=True)
    assert text["count"] == 3 and text["token_strs"] == ["one", "two", "three"]


def test_ids_decode_back_to_their_text(client):
    ids = tokenized(client, prompt="one two three two")["tokens"]
    assert ids[1] == ids[3]  # one word, one id
    for path in ("/detokenize", "/v1/detokenize"):
        reply = post(client, path, {"model": DEMO_MODEL, "tokens": ids})
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"prompt": "one two three two"}
    assert post(client, "/detokenize", {"model": DEMO_MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "temperature": 0}, "temperature"),  # not a parameter of /tokenize
        ({"messages": CHAT, "prompt": "a"}, "prompt"),  # one form or the other
        ({"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
        ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
        ({"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
        (  # vLLM's refusal; the demo's model takes a prefill, not a chat without its end
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({}, "prompt"),
        ({"messages": "hi"}, "messages"),
        ({"messages": CHAT, "tools": "none"}, "tools"),
    ],
)
def test_a_bad_tokenize_body_is_refused_naming_its_parameter(client, body, param):
    error = refused(client, "/tokenize", {"model": DEMO_MODEL, **body})
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("tokens", "why"),
    [
        (None, "required"),
        ("1 2", "required"),
        ([1, -1], "token ids"),
        ([1, True], "token ids"),
        ([1, 2.0], "token ids"),
        ([2**32], "token ids"),
        ([0] * ((1 << 20) + 1), "at most"),
        ([10**6], "not a word"),  # the demo decodes the words it has tokenized
    ],
)
def test_bad_ids_are_refused_naming_tokens(client, tokens, why):
    body: dict[str, Any] = {"model": DEMO_MODEL}
    if tokens is not None:
        body["tokens"] = tokens
    error = refused(client, "/detokenize", body)
    assert error["param"] == "tokens" and why in error["message"], error


def test_detokenize_takes_only_its_fields(client):
    error = refused(client, "/detokenize", {"model": DEMO_MODEL, "tokens": [], "skip": True})
    assert error["param"] == "skip" and error["code"] == "unknown_parameter"


def test_models_that_cannot_show_tokens_and_unknown_ones_are_refused(client):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        error = refused(client, path, {"model": SCRIPTED_MODEL, **body})  # a first-version worker
        assert error["param"] == "model", error
        missing = refused(client, path, {"model": "no-such-model", **body}, 404)
        assert missing["code"] == "model_not_found"


def test_a_body_that_is_not_json_is_refused_before_any_work(client):
    reply = client.post("/tokenize", content=b"prompt=a", headers={"content-type": "text/plain"})
    assert reply.status_code == 415


# -- an OpenAI-compatible server's /tokenize and /detokenize (respx) ------------------

TOOLS = (Tool("get_weather", "the weather", '{"type": "object"}'),)
PROMPT = GenerateRequest("m", messages=(Message("user", "hi"),), tools=TOOLS, tool_choice="auto")


def over_http(call: Any) -> Any:
    async def run() -> Any:
        async with httpx.AsyncClient() as http:
            return await call(OpenAIHttpUpstream("http://upstream.test/v1", http, raw_http=False))

    return anyio.run(run)


@respx.mock
def test_an_openai_server_is_asked_vllms_tokenize_body():
    route = respx.post("http://upstream.test/tokenize").respond(
        200, json={"count": 2, "max_model_len": 64, "tokens": [5, 6], "token_strs": ["a", "b"]}
    )
    tokens = over_http(lambda u: u.tokenize(PROMPT, True, HANG_GUARD))
    assert tokens.ids == [5, 6] and tokens.strs == ["a", "b"]
    sent = orjson.loads(route.calls.last.request.content)
    assert set(sent) == {"model", "messages", "tools", "add_generation_prompt", "return_token_strs"}
    assert sent["return_token_strs"] is True and sent["add_generation_prompt"] is True
    detok = respx.post("http://upstream.test/detokenize").respond(200, json={"prompt": "ab"})
    assert over_http(lambda u: u.detokenize("m", [5, 6], HANG_GUARD)) == "ab"
    assert orjson.loads(detok.calls.last.request.content) == {"model": "m", "tokens": [5, 6]}


@respx.mock
def test_a_long_prompts_count_is_read_whole():
    """vLLM's `/tokenize` lists every id with the count: a 20,000-token prompt's answer
    (about 120 KB) is read whole, not cut at an error body's bound."""
    ids = [12345] * 20_000
    respx.post("http://upstream.test/tokenize").respond(
        200, json={"count": len(ids), "max_model_len": 32768, "tokens": ids}
    )
    assert over_http(lambda u: u.count_tokens(PROMPT, HANG_GUARD)) == 20_000


@respx.mock
@pytest.mark.parametrize(
    ("route", "status", "answer", "error"),
    [
        ("tokenize", 404, {"detail": "Not Found"}, errors.CannotCount),
        ("detokenize", 405, {"detail": "Method Not Allowed"}, errors.CannotCount),
        ("tokenize", 200, {"count": 1}, errors.Failed),  # no ids
        ("tokenize", 200, {"tokens": [1, -2]}, errors.Failed),
        ("tokenize", 200, {"tokens": [1], "token_strs": ["a", "b"]}, errors.Failed),
        ("tokenize", 200, [1, 2], errors.Failed),
        ("detokenize", 200, {"text": "a"}, errors.Failed),  # vLLM's field is `prompt`
        ("detokenize", 400, {"error": {"message": "bad", "param": "tokens"}}, errors.Invalid),
        ("tokenize", 503, {"error": {"message": "down"}}, errors.Unavailable),
    ],
)
def test_an_openai_servers_bad_answers_are_refused_clearly(route, status, answer, error):
    respx.post(f"http://upstream.test/{route}").respond(status, json=answer)

    async def ask(upstream: OpenAIHttpUpstream) -> Any:
        if route == "tokenize":
            return await upstream.tokenize(PROMPT, True, HANG_GUARD)
        return await upstream.detokenize("m", [1], HANG_GUARD)

    with pytest.raises(error) as raised:
        over_http(ask)
    if status in (404, 405):
        assert raised.value.param == "model"


@respx.mock
def test_an_openai_servers_answer_is_bounded_by_the_ids_it_decodes():
    respx.post("http://upstream.test/detokenize").respond(200, json={"prompt": "x" * 200_000})
    with pytest.raises(errors.Failed, match="larger"):
        over_http(lambda u: u.detokenize("m", [1, 2], HANG_GUARD))


# -- the gateway's own tokenizer (vllm-grpc): no engine asked ---------------------------


def test_vllm_grpc_shows_tokens_with_the_gateways_tokenizer(tmp_path):
    """Short and long prompts alike (a long one's strings and text are made off the
    event loop): the ids `count_tokens` counts, the tokenizer's own strings, its text."""
    from tokenizers import Tokenizer

    from gateway.upstreams.vllm_grpc import INLINE_CHARS, VllmGrpcUpstream
    from tests.support.tiny_model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    long = " ".join(["hello world"] * INLINE_CHARS)

    async def ask() -> list[Any]:
        # nothing listens there: the engine is never asked
        upstream = VllmGrpcUpstream("127.0.0.1:9", model="tiny", tokenizer=str(tmp_path))
        try:
            answers: list[Any] = []
            for text in ("hello world", long):
                request = GenerateRequest("tiny", prompt=text)
                tokens = await upstream.tokenize(request, True, HANG_GUARD)
                counted = await upstream.count_tokens(request, HANG_GUARD)
                text_back = await upstream.detokenize("tiny", tokens.ids, HANG_GUARD)
                answers.append((tokens, counted, text_back))
            with pytest.raises(errors.Invalid) as outside:
                await upstream.detokenize("tiny", [0, raw.get_vocab_size() + 5], HANG_GUARD)
            answers.append(outside.value.param)
            return answers
        finally:
            await upstream.close()

    *answers, param = anyio.run(ask)
    assert param == "tokens"
    for tokens, counted, text_back in answers:
        assert len(tokens.ids) == counted and tokens.strs == [
            raw.id_to_token(i) for i in tokens.ids
        ]
        assert text_back == raw.decode(tokens.ids, skip_special_tokens=False)
    assert len(answers[1][0].ids) > INLINE_CHARS
