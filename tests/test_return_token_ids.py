"""Specs: vLLM's `return_token_ids` on chat and completions, in vLLM 0.32's shapes: the
prompt's ids (a chat's at the answer's top level, a stream's in each choice's opening; a
completion's in each choice, a stream's in its first chunk) and each choice's `token_ids`,
a stream's chunk by chunk, so that a choice's chunks' ids joined are all of its tokens'
(those of a stop string cut from its text and the end of sequence too, as vLLM's).

Through the real gateway under uvicorn to real gRPC workers on loopback: the demo (a
word's id is its CRC-32: gateway/worker/demo.py's rules), a worker that does not list the
feature (refused by name), the transformers engine on the tiny model the tests build (its
ids are the tokenizer's); an OpenAI-compatible server (tests/support/openai_server.py,
sent the field and read back, over our own connections and over httpx). vLLM itself, for
`vllm-grpc` and `openai` upstreams: tests/test_vllm_grpc.py and
tests/test_http_upstream_surface.py."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ModelConfig
from gateway.protocol import features
from gateway.protocol.convert import event_from_proto, event_with_ids_to_proto
from gateway.protocol.types import Finished, FinishReason, GenerateRequest, Started, Text
from gateway.upstreams.openai_http.translate import request_body
from gateway.worker.demo import DemoEngine
from gateway.worker.transformers_engine import TransformersEngine
from tests.support.fronts import Front, engines_front
from tests.support.openai_server import (
    EOS_ID,
    FIRST_ID,
    PROMPT_IDS,
    OpenAIServer,
    keyed_plain,
    serving,
)
from tests.support.requests import sse_events, user
from tests.support.servers import DEMO_MODEL, ServerLoop, Workers, assert_nothing_left
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import HANG_GUARD

PROMPT = "one two three four"
IDS = {"return_token_ids": True}
HOSTED = "hosted-token-ids"
KEY_ENV = "FURNACE_TEST_TOKEN_IDS_KEY"
TINY = "tiny-token-ids"


def word_ids(text: str) -> list[int]:
    """The demo's ids of a text's words."""
    return [zlib.crc32(word.encode()) for word in text.split()]


def post(url: str, path: str, **body: Any) -> dict[str, Any]:
    reply = httpx.post(url + path, json=body, timeout=HANG_GUARD)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def stream(url: str, path: str, **body: Any) -> list[dict[str, Any]]:
    """A stream's chunks (without [DONE])."""
    reply = httpx.post(url + path, json={**body, "stream": True}, timeout=HANG_GUARD)
    assert reply.status_code == 200, reply.text
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def joined(chunks: list[dict[str, Any]], index: int, key: str) -> tuple[list[int], str]:
    """Choice `index`'s ids joined over its chunks, and its text (`key`: `text`, or a
    chat's `content`); every chunk that carries text carries ids."""
    ids: list[int] = []
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            piece = choice.get("text") if key == "text" else choice["delta"].get("content")
            if "token_ids" in choice:
                ids += choice["token_ids"]
            else:
                assert not piece, chunk  # an opening (or a chat's role) alone has none
            text += piece or ""
    return ids, text


# -- the demo, through the shared gateway -------------------------------------------


def test_a_completion_has_its_prompts_ids_and_its_answers(gateway):
    answer = post(gateway.url, "/v1/completions", model=DEMO_MODEL, prompt=PROMPT, **IDS)
    (choice,) = answer["choices"]
    assert choice["prompt_token_ids"] == word_ids(PROMPT)
    assert choice["token_ids"] == word_ids(choice["text"]) == word_ids(PROMPT)
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    assert "prompt_token_ids" not in answer  # a completion's are its choices'
    plain = post(gateway.url, "/v1/completions", model=DEMO_MODEL, prompt=PROMPT)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_a_chat_has_them_at_its_top_and_in_each_of_n_choices(gateway):
    messages = user(PROMPT)
    answer = post(
        gateway.url, "/v1/chat/completions", model=DEMO_MODEL, messages=messages, n=2, **IDS
    )
    assert answer["prompt_token_ids"] == word_ids(PROMPT)
    assert [c["token_ids"] for c in answer["choices"]] == [word_ids(PROMPT)] * 2
    assert answer["usage"]["completion_tokens"] == 2 * len(word_ids(PROMPT))
    off = post(
        gateway.url,
        "/v1/chat/completions",
        model=DEMO_MODEL,
        messages=messages,
        return_token_ids=False,
    )
    assert "prompt_token_ids" not in off and "token_ids" not in off["choices"][0]


def test_a_streamed_completions_chunks_join_to_each_choices_ids(gateway):
    chunks = stream(gateway.url, "/v1/completions", model=DEMO_MODEL, prompt=PROMPT, n=2, **IDS)
    for index in (0, 1):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        # the prompt's ids in each choice's first chunk only, as vLLM's server sends them
        assert mine[0]["prompt_token_ids"] == word_ids(PROMPT)
        assert all("prompt_token_ids" not in c for c in mine[1:])
        ids, text = joined(chunks, index, "text")
        assert text == PROMPT and ids == word_ids(PROMPT)


def test_a_streamed_chat_has_the_prompts_ids_in_its_opening(gateway):
    chunks = stream(
        gateway.url,
        "/v1/chat/completions",
        model=DEMO_MODEL,
        messages=user(PROMPT),
        stream_options={"include_usage": True},
        **IDS,
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["prompt_token_ids"] == word_ids(PROMPT)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids, text = joined(chunks, 0, "content")
    assert text == PROMPT and ids == word_ids(PROMPT)
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_stop_strings_tokens_are_among_the_ids_its_text_lost(gateway, streamed):
    """vLLM's ids are every token generated: the one that completed the stop string too,
    though its text is cut from the answer."""
    body = {"model": DEMO_MODEL, "messages": user(PROMPT), "stop": ["three"], **IDS}
    if streamed:
        ids, text = joined(stream(gateway.url, "/v1/chat/completions", **body), 0, "content")
    else:
        (choice,) = post(gateway.url, "/v1/chat/completions", **body)["choices"]
        ids, text = choice["token_ids"], choice["message"]["content"]
    assert text == "one two "
    assert ids == word_ids("one two three")


def test_a_completions_echo_gives_way_to_the_prompts_ids(gateway):
    """vLLM's completions: with `return_token_ids` the echoed prompt is left out of the
    text (its ids are there instead)."""
    body = {"model": DEMO_MODEL, "prompt": PROMPT, "echo": True}
    echoed = post(gateway.url, "/v1/completions", **body)["choices"][0]
    assert echoed["text"] == PROMPT + PROMPT
    (choice,) = post(gateway.url, "/v1/completions", **body, **IDS)["choices"]
    assert choice["text"] == PROMPT and choice["prompt_token_ids"] == word_ids(PROMPT)


def test_tool_calls_and_reasoning_carry_their_tokens_ids(gateway):
    """The demo's calls' pieces and its thought are tokens too: every one has its id."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    body = {
        "model": DEMO_MODEL,
        "messages": user(PROMPT),
        "tools": [tool],
        "tool_choice": "required",
        "reasoning_effort": "low",
        **IDS,
    }
    answer = post(gateway.url, "/v1/chat/completions", **body)
    (choice,) = answer["choices"]
    assert choice["message"]["reasoning"] == "four"
    assert choice["token_ids"][0] == zlib.crc32(b"four")
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    chunks = stream(gateway.url, "/v1/chat/completions", **body)
    ids = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids", ())]
    assert ids == choice["token_ids"]


@pytest.mark.parametrize("value", ["yes", 1, [], {}])
@pytest.mark.parametrize(
    ("path", "prompt"),
    [("/v1/chat/completions", {"messages": user("a")}), ("/v1/completions", {"prompt": "a"})],
)
def test_it_is_a_boolean(gateway, path, prompt, value):
    body = {"model": DEMO_MODEL, **prompt, "return_token_ids": value}
    reply = httpx.post(gateway.url + path, json=body, timeout=HANG_GUARD)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "return_token_ids" and error["type"] == "invalid_request_error"


def test_the_protocols_events_carry_the_ids_only_when_asked():
    started = Started(3, 1, (5, 6, 7))
    text = Text("hi", 2, 1, None, (8, 9))
    finished = Finished(FinishReason.STOP, 3, None, 1, "", None, (2,))
    for event in (started, text, finished):
        message = event_with_ids_to_proto(event)
        assert event_from_proto(message, True) == event
        assert event_from_proto(message) == event._replace(  # type: ignore[call-arg]
            **{"prompt_token_ids" if event is started else "token_ids": None}
        )


# -- a worker that does not list it ---------------------------------------------------


class NoIds(DemoEngine):
    """The demo without `return_token_ids`: an engine that cannot say its ids."""

    features = DemoEngine.features - {features.RETURN_TOKEN_IDS}

    def __init__(self) -> None:
        super().__init__("furnace-no-ids")

    def close(self) -> None:
        """Nothing to free (the fixture closes its engines)."""


@pytest.fixture(scope="module")
def without(server_loop: ServerLoop, workers: Workers) -> Iterator[Front]:
    with engines_front(server_loop, workers, [NoIds()]) as front:
        yield front


def test_a_worker_that_does_not_list_it_is_refused_by_name(without: Front):
    for path, body in (
        ("/v1/chat/completions", {"messages": user(PROMPT)}),
        ("/v1/completions", {"prompt": PROMPT, "stream": True}),
    ):
        reply = httpx.post(
            without.gateway.url + path,
            json={"model": "furnace-no-ids", **body, **IDS},
            timeout=HANG_GUARD,
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "return_token_ids" and "return_token_ids" in error["message"]
    # its plain requests are served
    post(without.gateway.url, "/v1/completions", model="furnace-no-ids", prompt=PROMPT)
    assert_nothing_left(without.gateway, None)


# -- an OpenAI-compatible server ------------------------------------------------------


def test_an_openai_server_is_sent_the_field():
    assert request_body(GenerateRequest("m", prompt="a", return_token_ids=True))["return_token_ids"]
    assert "return_token_ids" not in request_body(GenerateRequest("m", prompt="a"))


@pytest.fixture(params=["connections", "httpx"])
def hosted(
    request: pytest.FixtureRequest,
    server_loop: ServerLoop,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[OpenAIServer, ModelConfig]]:
    """The OpenAI-compatible server and its model: over our own connections (plain
    HTTP), or over httpx (TLS, a CA of its own)."""
    if request.param == "connections":
        with keyed_plain(server_loop, HOSTED, KEY_ENV, "hello") as server:
            yield (
                server,
                ModelConfig(HOSTED, workers=(server.url,), upstream="openai", api_key_env=KEY_ENV),
            )
        return
    with serving(server_loop, tmp_path, HOSTED) as (server, ca):
        monkeypatch.setenv(KEY_ENV, server.key)
        yield (
            server,
            ModelConfig(
                HOSTED,
                workers=(server.url,),
                upstream="openai",
                api_key_env=KEY_ENV,
                ca_file=ca.ca_file,
            ),
        )


def test_an_openai_servers_ids_are_read_back(gateway_with, hosted):
    """Its prompt's ids from its first chunk, each chunk's ids on what it carried, its end
    of sequence's (on its finish chunk, no text) on the answer's last; the plain request's
    stream is not asked for any."""
    server, model = hosted
    url = gateway_with(models=(model,)).url
    body = {"model": HOSTED, "messages": user("hi"), **IDS}
    answer = post(url, "/v1/chat/completions", **body)
    assert server.last_body["return_token_ids"] is True
    assert answer["prompt_token_ids"] == PROMPT_IDS
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == "hello"
    assert choice["token_ids"] == [FIRST_ID, EOS_ID]
    chunks = stream(url, "/v1/chat/completions", **body)
    assert chunks[0]["prompt_token_ids"] == PROMPT_IDS
    assert joined(chunks, 0, "content") == ([FIRST_ID, EOS_ID], "hello")
    plain = post(url, "/v1/chat/completions", model=HOSTED, messages=user("hi"))
    assert "return_token_ids" not in server.last_body
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


# -- the transformers engine on the tiny model ----------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / TINY)


@pytest.fixture(scope="module")
def tiny(server_loop: ServerLoop, workers: Workers, tiny_path: Path) -> Iterator[Front]:
    with engines_front(
        server_loop, workers, [TransformersEngine(tiny_path, device="cpu")]
    ) as front:
        yield front


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_the_transformers_engines_ids_are_its_tokenizers(tiny: Front, tiny_path: Path, route):
    """The prompt's ids are the tokenizer's encoding of it (through the chat template, for
    a chat); the answer's, one per token counted, decode to its text, whole and streamed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_path))
    fields: dict[str, Any] = {"model": TINY, "max_tokens": 6, "temperature": 0, **IDS}
    if route == "chat":
        fields["messages"] = user("hello from the fleet")
        prompt = tokenizer.apply_chat_template(
            fields["messages"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        path, key = "/v1/chat/completions", "content"
        answer = post(tiny.gateway.url, path, **fields)
        prompt_ids, (choice,) = answer["prompt_token_ids"], answer["choices"]
        text = choice["message"]["content"]
    else:
        fields["prompt"] = "hello from the fleet"
        prompt = tokenizer("hello from the fleet")["input_ids"]
        path, key = "/v1/completions", "text"
        answer = post(tiny.gateway.url, path, **fields)
        (choice,) = answer["choices"]
        prompt_ids, text = choice["prompt_token_ids"], choice["text"]
    assert prompt_ids == list(prompt)
    ids = choice["token_ids"]
    assert len(ids) == answer["usage"]["completion_tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert joined(stream(tiny.gateway.url, path, **fields), 0, key) == (ids, text)
    assert_nothing_left(tiny.gateway, None)
