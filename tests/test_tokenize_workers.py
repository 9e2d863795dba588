"""The worker SDK's Tokenize and Detokenize (vLLM's /tokenize and /detokenize, for the
gateway), against real workers on loopback with a raw grpc.aio client: the demo's
words and ids (round-tripping through Detokenize, as many as CountTokens counts), the
transformers engine's ids and strings as its Hugging Face tokenizer makes them, and
the SDK's refusals: an engine that does not list "tokenize" (or lists it without
implementing it), an unknown model, an id outside the vocabulary, too many ids, a
reply too large. The vLLM engine's: tests/test_vllm_engine.py."""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.protocol import errors, features
from gateway.protocol.convert import request_to_proto
from gateway.protocol.status import error_from_status
from gateway.protocol.types import GenerateRequest, Message, Tool
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker import demo, servicer
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.engine import MAX_DETOKENIZE_IDS
from gateway.worker.server import WorkerServer
from tests.support.script_engine import ScriptEngine
from tests.support.servers import ServerLoop
from tests.support.tiny_model import build_tiny_model

CHAT = GenerateRequest(
    DEMO_MODEL,
    messages=(
        Message("system", "be brief"),
        Message("user", "three words here"),
        Message("assistant", "here we go", reasoning="thinking hard"),
        Message("user", "be brief again"),
    ),
    tools=(Tool("get_weather", "the weather", '{"type": "object"}'),),
)
CHAT_WORDS = ["be", "brief", "three", "words", "here", "thinking", "hard"]
CHAT_WORDS += ["here", "we", "go", "be", "brief", "again"]
PROMPT = GenerateRequest(DEMO_MODEL, prompt="one two  three\ttwo one")

Reply = Any  # a reply message, or the call's AioRpcError


def tokenize(
    server_loop: ServerLoop, worker: WorkerServer, request: GenerateRequest, strs: bool = False
) -> Reply:
    message = pb.TokenizeRequest(prompt=request_to_proto(request), token_strs=strs)

    async def ask() -> Reply:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            try:
                return await pb_grpc.EngineStub(channel).Tokenize(message, timeout=30)
            except grpc.aio.AioRpcError as error:
                return error

    return server_loop.call(ask())


def detokenize(
    server_loop: ServerLoop, worker: WorkerServer, ids: Sequence[int], model: str | None = None
) -> Reply:
    model = worker.engine.model if model is None else model
    message = pb.DetokenizeRequest(request_id="r1", model=model, ids=ids)

    async def ask() -> Reply:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            try:
                return await pb_grpc.EngineStub(channel).Detokenize(message, timeout=30)
            except grpc.aio.AioRpcError as error:
                return error

    return server_loop.call(ask())


def count(server_loop: ServerLoop, worker: WorkerServer, request: GenerateRequest) -> int:
    async def ask() -> int:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            reply = await stub.CountTokens(request_to_proto(request), timeout=30)
            return int(reply.prompt_tokens)

    return server_loop.call(ask())


def refused(reply: Reply, code: grpc.StatusCode, param: str | None = None) -> str:
    """Asserts the call failed with `code` (naming `param`); its message."""
    assert isinstance(reply, grpc.aio.AioRpcError), reply
    assert reply.code() == code, reply.details()
    if param is not None:
        assert ("furnace-param", param) in tuple(reply.trailing_metadata())
    return reply.details() or ""


# -- the demo: a word is a token ---------------------------------------------------------


def test_the_demos_ids_are_its_words_and_round_trip(server_loop, serve_engines):
    (worker,) = serve_engines(DemoEngine())
    for request, words in ((CHAT, CHAT_WORDS), (PROMPT, PROMPT.prompt.split())):
        reply = tokenize(server_loop, worker, request, strs=True)
        ids = list(reply.ids)
        assert len(ids) == count(server_loop, worker, request) == len(words)
        assert list(reply.token_strs) == words
        # one id per distinct word, the same each time it comes back
        assert len(set(ids)) == len(set(words))
        assert [ids[words.index(w)] for w in words] == ids
        assert detokenize(server_loop, worker, ids).text == " ".join(words)
        assert tokenize(server_loop, worker, request).ids == ids  # the same again
        assert list(tokenize(server_loop, worker, request).token_strs) == []  # not asked
    # a word's id is the CRC-32 of its bytes: the same on every demo worker
    crc = [zlib.crc32(w.encode()) for w in CHAT_WORDS]
    assert list(tokenize(server_loop, worker, CHAT).ids) == crc
    assert detokenize(server_loop, worker, []).text == ""


def test_the_demo_lists_tokenize(server_loop, serve_engines):
    (worker,) = serve_engines(DemoEngine())

    async def describe() -> pb.DescribeResponse:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            return await pb_grpc.EngineStub(channel).Describe(pb.DescribeRequest(), timeout=30)

    (model,) = server_loop.call(describe()).models
    assert features.TOKENIZE in model.features


def test_an_id_the_demo_never_gave_is_refused_naming_tokens(server_loop, serve_engines):
    (worker,) = serve_engines(DemoEngine())
    ids = list(tokenize(server_loop, worker, PROMPT).ids)
    message = refused(
        detokenize(server_loop, worker, [*ids, 3]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"
    )
    assert "3" in message
    other = zlib.crc32(b"elsewhere")  # another worker's word: refused here, never mistaken
    refused(detokenize(server_loop, worker, [other]), grpc.StatusCode.INVALID_ARGUMENT, "tokens")
    big = 2**32 - 1
    refused(detokenize(server_loop, worker, [big]), grpc.StatusCode.INVALID_ARGUMENT, "tokens")


def test_the_demo_forgets_its_oldest_words_past_its_bound(server_loop, serve_engines, monkeypatch):
    """It decodes the last `DEMO_VOCABULARY` words it tokenized (of at most
    `DEMO_VOCABULARY_CHARS` characters): an older one's id is refused, never mistaken."""
    monkeypatch.setattr(demo, "DEMO_VOCABULARY", 4)
    (worker,) = serve_engines(DemoEngine())
    crc = {w: zlib.crc32(w.encode()) for w in ("one", "two", "three", "four", "five")}
    tokenize(server_loop, worker, PROMPT)  # "one two three two one": three, two, one last
    tokenize(server_loop, worker, GenerateRequest(DEMO_MODEL, prompt="four five"))
    refused(
        detokenize(server_loop, worker, [crc["three"]]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"
    )
    ids = [crc[w] for w in ("two", "one", "four", "five")]
    assert detokenize(server_loop, worker, ids).text == "two one four five"
    monkeypatch.setattr(demo, "DEMO_VOCABULARY", 100)
    monkeypatch.setattr(demo, "DEMO_VOCABULARY_CHARS", 8)
    tokenize(server_loop, worker, GenerateRequest(DEMO_MODEL, prompt="six"))  # 17 chars: 8 kept
    for gone in ("two", "one", "four"):
        refused(
            detokenize(server_loop, worker, [crc[gone]]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"
        )
    ids = [crc["five"], zlib.crc32(b"six")]
    assert detokenize(server_loop, worker, ids).text == "five six"


def test_the_demo_bounds_the_text_it_decodes(server_loop, serve_engines, monkeypatch):
    (worker,) = serve_engines(DemoEngine())
    ids = list(tokenize(server_loop, worker, PROMPT).ids)  # "one two three two one": 21
    monkeypatch.setattr(demo, "MAX_DETOKENIZED_CHARS", 20)
    refused(detokenize(server_loop, worker, ids), grpc.StatusCode.INVALID_ARGUMENT, "tokens")
    assert detokenize(server_loop, worker, ids[:-1]).text == "one two three two"


# -- the SDK's refusals ------------------------------------------------------------------


class ListsTokenize(ScriptEngine):
    """Lists "tokenize" but keeps the Engine's defaults."""

    features = features.FIRST_VERSION | {features.TOKENIZE}


class Broken(DemoEngine):
    """Fails as an engine may: an exception, or strings that do not match the ids."""

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        if request.prompt == "raise":
            raise RuntimeError("boom")
        return await super().tokenize(request)

    async def token_strs(self, ids: Sequence[int]) -> list[str]:
        return (await super().token_strs(ids))[:-1]

    async def detokenize(self, ids: Sequence[int]) -> str:
        raise RuntimeError("boom")


def test_an_engine_without_the_feature_refuses_naming_model(server_loop, serve_engines):
    without, listing = serve_engines(ScriptEngine([]), ListsTokenize([]))
    for worker in (without, listing):
        request = GenerateRequest("script-engine", prompt="a b")
        message = refused(
            tokenize(server_loop, worker, request), grpc.StatusCode.INVALID_ARGUMENT, "model"
        )
        assert "does not tokenize" in message
        refused(detokenize(server_loop, worker, [1]), grpc.StatusCode.INVALID_ARGUMENT, "model")
    # as the gateway reads it: it cannot count (tokenize) with this model
    reply = tokenize(server_loop, without, GenerateRequest("script-engine", prompt="a"))
    error = error_from_status(reply.code(), reply.details(), reply.trailing_metadata())
    assert isinstance(errors.CannotCount.of(error), errors.CannotCount)


def test_an_unknown_model_is_not_found(server_loop, serve_engines):
    (worker,) = serve_engines(DemoEngine())
    elsewhere = GenerateRequest("elsewhere", prompt="a")
    refused(tokenize(server_loop, worker, elsewhere), grpc.StatusCode.NOT_FOUND)
    refused(detokenize(server_loop, worker, [0], model="elsewhere"), grpc.StatusCode.NOT_FOUND)
    # no model named: the worker's
    assert len(tokenize(server_loop, worker, GenerateRequest("", prompt="a b")).ids) == 2
    assert detokenize(server_loop, worker, [zlib.crc32(b"a")], model="").text == "a"


def test_too_many_ids_are_refused_before_the_engine(server_loop, serve_engines):
    (worker,) = serve_engines(DemoEngine())
    ids = list(tokenize(server_loop, worker, GenerateRequest(DEMO_MODEL, prompt="w")).ids)
    message = refused(
        detokenize(server_loop, worker, ids * (MAX_DETOKENIZE_IDS + 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokens",
    )
    assert str(MAX_DETOKENIZE_IDS) in message
    assert len(detokenize(server_loop, worker, ids * MAX_DETOKENIZE_IDS).text) == (
        2 * MAX_DETOKENIZE_IDS - 1
    )


def test_replies_past_their_bounds_are_refused(server_loop, serve_engines, monkeypatch):
    (worker,) = serve_engines(DemoEngine())
    words = GenerateRequest(DEMO_MODEL, prompt="w " * 100)
    ids = list(tokenize(server_loop, worker, words).ids)
    monkeypatch.setattr(servicer, "MAX_TOKENIZE_REPLY", 150)  # 100 ids: 102 bytes
    tokenize(server_loop, worker, words)  # fits
    refused(
        tokenize(server_loop, worker, words, strs=True), grpc.StatusCode.INVALID_ARGUMENT, "prompt"
    )
    chat = GenerateRequest(DEMO_MODEL, messages=(Message("user", "w " * 100),))
    refused(
        tokenize(server_loop, worker, chat, strs=True), grpc.StatusCode.INVALID_ARGUMENT, "messages"
    )
    monkeypatch.setattr(servicer, "MAX_DETOKENIZED_CHARS", 198)  # 100 "w"s: 199 characters
    refused(detokenize(server_loop, worker, ids), grpc.StatusCode.INVALID_ARGUMENT, "tokens")


def test_an_engine_that_fails_is_internal(server_loop, serve_engines):
    (worker,) = serve_engines(Broken())
    raising = GenerateRequest(DEMO_MODEL, prompt="raise")
    assert refused(tokenize(server_loop, worker, raising), grpc.StatusCode.INTERNAL) == (
        "The engine failed."
    )
    words = GenerateRequest(DEMO_MODEL, prompt="a b")
    assert len(tokenize(server_loop, worker, words).ids) == 2
    refused(tokenize(server_loop, worker, words, strs=True), grpc.StatusCode.INTERNAL)
    refused(detokenize(server_loop, worker, [0]), grpc.StatusCode.INTERNAL)


# -- the transformers engine: its Hugging Face tokenizer ---------------------------------

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello from the fleet"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from gateway.worker.transformers_engine import TransformersEngine

    path: Path = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-tokenize")
    engine = TransformersEngine(path, device="cpu")
    yield engine
    engine.close()


def test_the_transformers_engine_tokenizes_as_its_tokenizer(server_loop, serve_engines, tiny):
    (worker,) = serve_engines(tiny)
    tokenizer = tiny.tokenizer
    chat = GenerateRequest(tiny.model, messages=tuple(Message(**m) for m in MESSAGES))
    expected = list(
        tokenizer.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    prompt = GenerateRequest(tiny.model, prompt="hello world, héllo 中文")
    for request, wanted in ((chat, expected), (prompt, list(tokenizer(prompt.prompt).input_ids))):
        reply = tokenize(server_loop, worker, request, strs=True)
        ids = list(reply.ids)
        assert ids == wanted
        assert len(ids) == count(server_loop, worker, request)
        assert list(reply.token_strs) == tokenizer.convert_ids_to_tokens(ids)
        text = detokenize(server_loop, worker, ids).text
        assert text == tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False)
    # special tokens are kept, as vLLM's /detokenize keeps them
    specials = [i for i in expected if i in tokenizer.all_special_ids]
    if specials:
        decoded = detokenize(server_loop, worker, specials).text
        assert decoded and decoded == tokenizer.decode(specials)


def test_the_transformers_engine_ends_a_chat_as_asked(server_loop, serve_engines, tiny):
    """vLLM's `add_generation_prompt` and `continue_final_message` (a prefill) reach its
    template as transformers takes them; the demo, which renders none, refuses the first
    by name, as Generate would."""
    (worker, demo_worker) = serve_engines(tiny, DemoEngine())
    prefill = [*MESSAGES, {"role": "assistant", "content": "The fleet says"}]
    for messages, ends in (
        (MESSAGES, {"add_generation_prompt": False}),
        (prefill, {"add_generation_prompt": False, "continue_final_message": True}),
    ):
        request = GenerateRequest(
            tiny.model, messages=tuple(Message(**m) for m in messages), **ends
        )
        expected = tiny.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, **ends
        )
        assert list(tokenize(server_loop, worker, request).ids) == list(expected)
        assert count(server_loop, worker, request) == len(expected)
    bare = GenerateRequest(DEMO_MODEL, messages=CHAT.messages, add_generation_prompt=False)
    reply = tokenize(server_loop, demo_worker, bare)
    refused(reply, grpc.StatusCode.INVALID_ARGUMENT, "add_generation_prompt")


def test_the_transformers_engine_refuses_ids_outside_its_vocabulary(
    server_loop, serve_engines, tiny
):
    (worker,) = serve_engines(tiny)
    last = tiny.decodable - 1
    assert detokenize(server_loop, worker, [0, last]).text == tiny.tokenizer.decode([0, last])
    message = refused(
        detokenize(server_loop, worker, [0, last + 1]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"
    )
    assert str(last + 1) in message


def test_the_transformers_engine_keeps_the_last_ids_of_the_rendered_chat(tiny):
    """vLLM's `truncate_prompt_tokens`: the last N ids of the chat it renders."""
    messages = (Message("user", "hello from the fleet, hello again"),)
    whole = tiny.prepare(GenerateRequest(tiny.model, messages=messages)).prompt
    cut = tiny.prepare(GenerateRequest(tiny.model, messages=messages, truncate_prompt_tokens=4))
    assert len(whole) > 4 and cut.prompt == whole[-4:]
