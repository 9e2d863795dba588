"""A SentencePiece-style tokenizer's answer over vLLM's gRPC server (the gateway
detokenizes) is what vLLM's own OpenAI server says: the tiny model with a Metaspace
tokenizer (`build_tiny_model(metaspace=True)`, words as `▁`-led pieces), whose decoder
drops a sequence's first token's leading space. vLLM's detokenizer decodes the answer after
the prompt, so its first word keeps its space; so does the gateway's (it starts after the
prompt's last ids). Greedy, so both answers are the same tokens, or n of 2 with a bias that
leaves the sampler one token; chats and completions, whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from tests.support.fronts import gateway_over, grpc_model, openai_at
from tests.support.requests import user
from tests.support.servers import Gateway, ServerLoop
from tests.support.tiny_model import build_tiny_model
from tests.support.vllm import VllmProcess, start_grpc_server, start_http_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-metaspace"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def metaspace_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("metaspace"), for_vllm=True, metaspace=True)


@pytest.fixture(scope="module")
def vllm_http(metaspace_model: Path) -> Iterator[VllmProcess]:
    with start_http_server(metaspace_model, metaspace_model, name=MODEL) as server:
        yield server


@pytest.fixture(scope="module")
def vllm_grpc(metaspace_model: Path) -> Iterator[VllmProcess]:
    with start_grpc_server(metaspace_model, metaspace_model) as server:
        yield server


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop, vllm_grpc: VllmProcess, metaspace_model: Path
) -> Iterator[Gateway]:
    with gateway_over(server_loop, (grpc_model(MODEL, vllm_grpc, metaspace_model),)) as gw:
        yield gw


@pytest.fixture(scope="module")
def clients(
    front: Gateway, vllm_http: VllmProcess
) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    """The SDK through the gateway (vLLM's gRPC server) and straight to vLLM's server."""
    with (
        openai_at(front.url + "/v1") as through,
        openai_at(f"http://127.0.0.1:{vllm_http.port}/v1") as direct,
    ):
        yield through, direct


def sure(model: Path) -> int:
    """`▁Sure,`'s id: a bias on it makes every answer begin with a `▁`-led word."""
    token = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("▁Sure,")
    assert token is not None
    return token


def texts(client: openai.OpenAI, chat: bool, **fields: Any) -> list[str]:
    """Each choice's text, whole, then streamed."""
    body = {**GREEDY, **fields}
    if chat:
        whole = client.chat.completions.create(model=MODEL, messages=user("hello there"), **body)
        said = [c.message.content or "" for c in whole.choices]
        stream = client.chat.completions.create(
            model=MODEL, messages=user("hello there"), stream=True, **body
        )
        pieces = [(c.index, c.delta.content or "") for e in stream for c in e.choices]
    else:
        whole = client.completions.create(model=MODEL, prompt="hello from the", **body)
        said = [c.text for c in whole.choices]
        stream = client.completions.create(
            model=MODEL, prompt="hello from the", stream=True, **body
        )
        pieces = [(c.index, c.text) for e in stream for c in e.choices]
    streamed = ["".join(p for i, p in pieces if i == index) for index in range(len(said))]
    return said + streamed


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
@pytest.mark.parametrize("biased", [False, True], ids=["model", "sure"])
def test_the_answer_reads_as_vllm_s_server_says_it(
    clients: tuple[openai.OpenAI, openai.OpenAI], metaspace_model: Path, chat: bool, biased: bool
) -> None:
    through, direct = clients
    fields: dict[str, Any] = {}
    if biased:  # n of 2 takes sampling (vLLM refuses it greedy): the bias decides alone
        fields = {"logit_bias": {str(sure(metaspace_model)): 100}, "n": 2, "temperature": 1}
    ours, theirs = texts(through, chat, **fields), texts(direct, chat, **fields)
    assert ours == theirs
    assert all(ours)
    if biased:  # its first word's space kept, as after the prompt
        assert all(text.startswith(" Sure,") for text in ours)
