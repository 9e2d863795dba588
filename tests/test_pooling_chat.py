"""The chat form of `POST /v1/embeddings` and `/classify` (vLLM's): `messages`, one
conversation (or, for embeddings, a batch of them, or a conversation as `input`), each
rendered by the model's chat template with `add_generation_prompt`,
`continue_final_message`, `add_special_tokens` and `chat_template_kwargs`, and pooled as
one input. Against vLLM's CPU build serving the tiny model as an embedding model twice:
its OpenAI server, reached directly and through the gateway (`upstream: openai`: the
server renders), and its gRPC server through the gateway (`vllm-grpc`: the gateway
renders with its own tokenizer); and the tiny model with a two-class head, on its
OpenAI server. Every answer
equals vLLM's own for the same body: the vectors (the classes) and the prompt's tokens.
Models on the worker protocol refuse a conversation by name, as every malformed body is
refused. After each test nothing is left in the gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ModelConfig
from gateway.worker.demo import DEMO_MODEL
from tests.support.fronts import gateway_over, grpc_model
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left
from tests.support.tiny_model import build_classifier
from tests.support.vllm import (
    MAX_MODEL_LEN,
    VllmProcess,
    start_grpc_server,
    start_lean_http_server,
)
from tests.support.vllm_worker import EMBED_MODEL, EMBED_OPTIONS
from tests.support.waiting import HANG_GUARD

#: vLLM's engines start in the first test's setup (tens of seconds on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

#: The same engine's model behind the gateway's `vllm-grpc` upstream.
RENDERED = "tiny-vllm-embed-grpc"
#: The tiny model with a classification head of two labels, on vLLM's OpenAI server.
CLASSIFIER = "tiny-vllm-classify"
POOLING = ("--runner", "pooling")
CHAT = [
    {"role": "system", "content": "you are terse"},
    {"role": "user", "content": "the quick brown fox"},
]
#: A conversation whose last message is the assistant's, to continue.
PREFILL = [*CHAT, {"role": "assistant", "content": "jumps over"}]


@pytest.fixture(scope="module")
def servers(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmProcess, VllmProcess, VllmProcess]]:
    """vLLM's OpenAI server and its gRPC server, each serving the tiny model as an
    embedding model (vLLM's pooling runner), and its OpenAI server serving a classifier."""
    logs = tmp_path_factory.mktemp("vllm-pooling-chat-logs")
    classifier = build_classifier(tmp_path_factory.mktemp("tiny-classifier"), labels=2)
    with ExitStack() as stack:  # each stopped, the last started first
        yield (
            stack.enter_context(
                start_lean_http_server(vllm_model, logs, EMBED_MODEL, MAX_MODEL_LEN, EMBED_OPTIONS)
            ),
            stack.enter_context(start_grpc_server(vllm_model, logs, EMBED_OPTIONS)),
            stack.enter_context(
                start_lean_http_server(classifier, logs, CLASSIFIER, MAX_MODEL_LEN, POOLING)
            ),
        )


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    servers: tuple[VllmProcess, VllmProcess, VllmProcess],
) -> Iterator[Gateway]:
    http, grpc, classifier = servers
    models = (
        ModelConfig(EMBED_MODEL, upstream="openai", workers=(f"http://127.0.0.1:{http.port}/v1",)),
        grpc_model(RENDERED, grpc, vllm_model),
        ModelConfig(
            CLASSIFIER,
            upstream="openai",
            workers=(f"http://127.0.0.1:{classifier.port}/v1",),
        ),
        ModelConfig(DEMO_MODEL, workers=(workers.demo.address,)),
    )
    with gateway_over(server_loop, models, workers) as gw:
        yield gw


@pytest.fixture
def client(front: Gateway, workers: Workers) -> Iterator[httpx.Client]:
    """httpx to the gateway; after the test, nothing left in it."""
    with httpx.Client(base_url=front.url, timeout=HANG_GUARD) as http:
        yield http
    assert_nothing_left(front, workers)


def direct(servers: tuple[VllmProcess, ...], body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own answer to `body` (the served name put in)."""
    url = f"http://127.0.0.1:{servers[0].port}/v1/embeddings"
    answer = httpx.post(url, json={**body, "model": EMBED_MODEL}, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def through(client: httpx.Client, model: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post("/v1/embeddings", json={**body, "model": model})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The same vectors, in order, and the same prompt tokens."""
    assert [d["index"] for d in ours["data"]] == [d["index"] for d in theirs["data"]]
    for mine, own in zip(ours["data"], theirs["data"], strict=True):
        assert mine["embedding"] == pytest.approx(own["embedding"], rel=1e-4, abs=1e-6)
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


BODIES = {
    "messages": {"messages": CHAT},
    "generation prompt": {"messages": CHAT, "add_generation_prompt": True},
    "continued": {"messages": PREFILL, "continue_final_message": True},
    "special tokens": {"messages": CHAT, "add_special_tokens": True},
    "template kwargs": {"messages": CHAT, "chat_template_kwargs": {"style": "terse"}},
    "batched": {"messages": [CHAT, PREFILL]},
    "as input": {"input": CHAT},
    "with user": {"messages": CHAT, "user": "team-a"},
}


@pytest.mark.parametrize("model", [EMBED_MODEL, RENDERED], ids=["openai", "vllm-grpc"])
@pytest.mark.parametrize("form", list(BODIES))
def test_a_conversation_is_embedded_as_vllm_embeds_it(client, servers, model, form):
    body = BODIES[form]
    assert_same(through(client, model, body), direct(servers, body))


def test_the_chat_form_differs_from_the_text(client, servers):
    """A conversation is its template's rendering, not its texts: vLLM's own vector of
    the rendered text is the conversation's."""
    chat = through(client, RENDERED, {"messages": CHAT})
    text = through(client, RENDERED, {"input": "the quick brown fox"})
    assert chat["data"][0]["embedding"] != pytest.approx(text["data"][0]["embedding"])
    rendered = "<|system|>you are terse<|end|><|user|>the quick brown fox<|end|>"
    tokens = client.post("/tokenize", json={"model": RENDERED, "prompt": rendered}).json()
    # the tokenizer adds no BOS to a rendered chat: the text form's ids are the chat's
    assert tokens["count"] == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT, "input": "x"}, "input"),
        ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"input": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
        (
            {"messages": PREFILL, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": CHAT, "media_io_kwargs": {"image": {}}}, "media_io_kwargs"),
        ({"messages": CHAT, "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [CHAT, [{"role": "robot", "content": "x"}]]}, "messages[1][0].role"),
        ({"messages": [CHAT, []]}, "messages[1]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"messages": [CHAT] * 2049}, "messages"),
    ],
)
def test_a_bad_chat_form_is_refused_by_name(client, body, param):
    answer = client.post("/v1/embeddings", json={**body, "model": RENDERED})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error


@pytest.mark.parametrize(
    ("part", "feature"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image_url"),
        (
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            "input_audio",
        ),
    ],
)
def test_the_gateways_own_rendering_refuses_media_by_name(client, part, feature):
    """`vllm-grpc` renders a conversation with the gateway's tokenizer, which takes no
    image nor sound: refused, not dropped."""
    said = {"role": "user", "content": [{"type": "text", "text": "look"}, part]}
    for body, param in (
        ({"messages": [*CHAT, said]}, "messages[2].content"),
        ({"messages": [CHAT, [said]]}, "messages[1][0].content"),
    ):
        answer = client.post("/v1/embeddings", json={**body, "model": RENDERED})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == param
        assert error["message"] == f"The model `{RENDERED}` does not support '{feature}'."


def test_a_model_on_the_worker_protocol_refuses_a_conversation_by_name(client):
    answer = client.post("/v1/embeddings", json={"model": DEMO_MODEL, "messages": CHAT})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "messages"
    assert "not conversations" in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": CHAT},
        {"messages": PREFILL, "continue_final_message": True},
        {"messages": CHAT, "add_generation_prompt": True, "add_special_tokens": True},
    ],
    ids=["messages", "continued", "options"],
)
def test_a_conversation_is_classified_as_vllm_classifies_it(client, servers, body):
    url = f"http://127.0.0.1:{servers[2].port}/classify"
    own = httpx.post(url, json={**body, "model": CLASSIFIER}, timeout=HANG_GUARD)
    assert own.status_code == 200, own.text
    theirs = own.json()
    ours = client.post("/classify", json={**body, "model": CLASSIFIER})
    assert ours.status_code == 200, ours.text
    (mine,), (their,) = ours.json()["data"], theirs["data"]
    assert mine["label"] == their["label"] and mine["num_classes"] == their["num_classes"]
    assert mine["probs"] == pytest.approx(their["probs"], abs=1e-3)
    assert ours.json()["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [CHAT, CHAT]}, "messages"),  # vLLM classifies one conversation
        ({"input": CHAT}, "input"),  # nor reads one as `input`
        ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": CHAT, "use_activation": False}, "use_activation"),
    ],
)
def test_a_bad_classify_chat_form_is_refused_by_name(client, body, param):
    answer = client.post("/classify", json={**body, "model": CLASSIFIER})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
