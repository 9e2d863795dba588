"""Our worker with `--engine vllm` (vLLM's AsyncLLM in the worker's process) behind
the gateway, end to end: started from vLLM's own virtualenv as the command line
runs it, on the tiny model (random weights: its text is junk, so the tests check
counts, finish reasons and behaviours, and text only for determinism at
temperature 0).

It reports NOT_SERVING while the engine starts; `Describe` says the engine's
`max_model_len` and `max_num_seqs`, and its load is vLLM's count of the requests it
holds, which shows 8 concurrent streams in the engine at once and requests whose
clients left gone from it (aborted, as the worker's log says).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.protocol.convert import request_to_proto
from gateway.protocol.types import GenerateRequest, Message
from gateway.protocol.v1 import engine_pb2, engine_pb2_grpc
from tests.support.requests import opened, user
from tests.support.servers import ServerLoop, Workers, assert_nothing_left
from tests.support.vllm import MAX_MODEL_LEN, START_GUARD
from tests.support.vllm_worker import MAX_NUM_SEQS, MODEL, Front, VllmWorker, open_front
from tests.support.waiting import wait_until

#: The first test also waits for the worker to start (importing vLLM, then its engine).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(START_GUARD + 60)]

MESSAGES = user("hello from the fleet")
#: A prompt whose greedy answer runs on for hundreds of tokens (no end of sequence).
LONG = {"prompt": "one two three", "max_tokens": MAX_MODEL_LEN - 64, "temperature": 0}


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop, workers: Workers, vllm_worker: VllmWorker, vllm_model: Path
) -> Iterator[Front]:
    with open_front(server_loop, workers, vllm_worker, vllm_model) as opened:
        yield opened


@pytest.fixture(autouse=True)
def _nothing_left(front: Front) -> Iterator[None]:
    yield
    assert_nothing_left(front.gateway, None)
    wait_until(lambda: front.worker.load() == 0, "the engine to hold no request")


def _chat_tokens(tokenizer: Any) -> int:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_health_is_not_serving_until_the_engine_is_up(front: Front):
    assert front.worker.health[0] == "NOT_SERVING"
    assert front.worker.health[-1] == "SERVING"


def test_describe_reports_the_engines_own_numbers(front: Front):
    described = front.worker.describe()
    assert [(m.name, m.max_context) for m in described.models] == [(MODEL, MAX_MODEL_LEN)]
    assert described.capacity == MAX_NUM_SEQS
    assert described.load == 0
    listed = {m.id: m for m in front.sdk.models.list().data}
    assert listed[MODEL].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_reports_usage_and_streams_the_same_answer(front: Front):
    reply = front.sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16
    )
    assert reply.usage.prompt_tokens == _chat_tokens(front.tokenizer)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16

    chunks = list(
        front.sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # temperature 0 is deterministic
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage == reply.usage


def test_completions_count_the_prompt_with_the_models_tokenizer(front: Front):
    reply = front.sdk.completions.create(
        model=MODEL, prompt="the quick brown fox", temperature=0, max_tokens=5
    )
    assert reply.usage.prompt_tokens == len(front.tokenizer("the quick brown fox").input_ids)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 5)
    again = front.sdk.completions.create(
        model=MODEL, prompt="the quick brown fox", temperature=0, max_tokens=5
    )
    assert again.choices[0].text == reply.choices[0].text


def test_tokenize_gives_the_ids_it_counts_and_detokenize_decodes_them(front: Front):
    """The worker's Tokenize (vLLM's /tokenize): the ids `generate` renders, as many as
    CountTokens counts, with `convert_ids_to_tokens`' strings; Detokenize:
    `tokenizer.decode`, special tokens kept; an id outside the vocabulary named."""
    tokenizer = front.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(text, add_special_tokens=False)
    chat = GenerateRequest(MODEL, messages=tuple(Message(**m) for m in MESSAGES))
    # a prefill (vLLM's continue_final_message): the chat cut after the last message's text
    prefill = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    opened = tokenizer.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    continued = GenerateRequest(
        MODEL,
        messages=tuple(Message(**m) for m in prefill),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    with grpc.insecure_channel(f"127.0.0.1:{front.worker.port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for request, wanted in (
            (chat, chat_ids),
            (continued, tokenizer.encode(opened, add_special_tokens=False)),
            (GenerateRequest(MODEL, prompt="the quick fox"), tokenizer("the quick fox").input_ids),
        ):
            proto = request_to_proto(request)
            tokenized = engine_pb2.TokenizeRequest(prompt=proto, token_strs=True)
            reply = stub.Tokenize(tokenized, timeout=30)
            assert list(reply.ids) == wanted
            assert len(wanted) == stub.CountTokens(proto, timeout=30).prompt_tokens
            assert list(reply.token_strs) == tokenizer.convert_ids_to_tokens(wanted)
            decoded = stub.Detokenize(
                engine_pb2.DetokenizeRequest(model=MODEL, ids=wanted), timeout=30
            )
            assert decoded.text == tokenizer.decode(wanted, skip_special_tokens=False)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Detokenize(engine_pb2.DetokenizeRequest(model=MODEL, ids=[2**31]), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("furnace-param", "tokens") in raised.value.trailing_metadata()


def test_a_prompt_is_cut_to_its_last_tokens(front: Front):
    """vLLM's `truncate_prompt_tokens`: the engine is given the last N ids it renders."""
    ids = front.tokenizer("the quick brown fox jumps").input_ids
    cut = front.sdk.completions.create(
        model=MODEL,
        prompt="the quick brown fox jumps",
        temperature=0,
        max_tokens=4,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert len(ids) > 3 and cut.usage.prompt_tokens == 3


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_token_ids_are_the_prompts_and_the_engines_own(front: Front, stream: bool):
    """vLLM's `return_token_ids` through the vLLM engine: the prompt's ids are the model's
    tokenizer's, the answer's decode to its text, one per token counted (its end of
    sequence too); n choices each their own (tests/test_vllm_grpc.py compares the ids with
    vLLM's own)."""
    ids = front.tokenizer("the quick brown fox").input_ids
    made = front.sdk.completions.create(
        model=MODEL,
        prompt="the quick brown fox",
        temperature=1,
        seed=5,
        n=2,
        max_tokens=6,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body={"return_token_ids": True},
    )
    chunks = [c.model_dump() for c in made] if stream else [made.model_dump()]
    prompts, answers, texts = [], [[], []], ["", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice.get("prompt_token_ids") is not None:
                prompts.append(choice["prompt_token_ids"])
            answers[choice["index"]] += choice.get("token_ids") or []
            texts[choice["index"]] += choice["text"]
    assert prompts == [ids, ids]  # each choice's (a stream's first chunk of each)
    usage = chunks[-1]["usage"]
    assert sum(map(len, answers)) == usage["completion_tokens"]
    for answer, text in zip(answers, texts, strict=True):
        # (the text of an answer that ends inside a character leaves its first bytes out,
        # as vLLM's detokenizer does; the ids hold them)
        assert answer and front.tokenizer.decode(answer, skip_special_tokens=True).startswith(text)


def test_special_tokens_are_shown_when_asked(front: Front):
    """vLLM's `skip_special_tokens` reaches the engine's detokenizer: a special token
    (forced here by a bias) is left out of the text unless asked to show it."""
    user_tag = str(front.tokenizer.convert_tokens_to_ids("<|user|>"))
    forced: dict[str, Any] = {"max_tokens": 2, "temperature": 0, "logit_bias": {user_tag: 100}}
    hidden = front.sdk.completions.create(model=MODEL, prompt="hi", **forced)
    assert hidden.choices[0].text == ""
    shown = front.sdk.completions.create(
        model=MODEL, prompt="hi", **forced, extra_body={"skip_special_tokens": False}
    )
    assert shown.choices[0].text == "<|user|><|user|>"


def test_a_stop_string_from_a_greedy_answer_cuts_the_next(front: Front):
    first = front.sdk.completions.create(
        model=MODEL, prompt="one two three", temperature=0, max_tokens=24
    ).choices[0]
    text = first.text
    assert len(text) >= 8, text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    second = front.sdk.completions.create(
        model=MODEL, prompt="one two three", temperature=0, max_tokens=24, stop=[stop]
    ).choices[0]
    assert second.text == text[: text.index(stop)]
    assert second.finish_reason == "stop"


def test_eight_streams_run_in_the_engine_at_once(front: Front):
    aborted = front.worker.aborted()
    with contextlib.ExitStack() as stack:
        streams = []  # kept: dropping a stream's lines closes its connection
        for _ in range(8):
            response = stack.enter_context(
                front.http.stream(
                    "POST", "/v1/completions", json={"model": MODEL, **LONG, "stream": True}
                )
            )
            assert response.status_code == 200
            streams.append(opened(response))
        # All eight are in vLLM's batch together (its own count), not taking turns.
        wait_until(lambda: front.worker.load() == 8, "all 8 requests in the engine at once")
    # Their clients left: the engine aborted all eight.
    wait_until(lambda: front.worker.aborted() == aborted + 8, "the engine to abort all 8")


def test_eight_concurrent_answers_all_finish(front: Front):
    def ask(_: int) -> Any:
        return front.sdk.completions.create(
            model=MODEL, prompt="one two three", temperature=0, max_tokens=32
        )

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    assert {(r.choices[0].finish_reason, r.usage.completion_tokens) for r in replies} == {
        ("length", 32)
    }
    assert len({r.choices[0].text for r in replies}) == 1  # the same greedy answer, batched


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_too_long_a_prompt_is_context_length_exceeded(front: Front, route: str):
    words = "one two three four " * 400
    assert len(front.tokenizer(words).input_ids) > MAX_MODEL_LEN
    if route == "chat":
        body: dict[str, Any] = {"model": MODEL, "messages": user(words)}
        url = "/v1/chat/completions"
    else:
        body, url = {"model": MODEL, "prompt": words}, "/v1/completions"
    response = front.http.post(url, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")


def test_a_client_that_leaves_aborts_the_request_in_the_engine(front: Front):
    aborted = front.worker.aborted()
    with front.http.stream(
        "POST", "/v1/completions", json={"model": MODEL, **LONG, "stream": True}
    ) as response:
        lines = opened(response)
        next(lines)
        wait_until(lambda: front.worker.load() == 1, "the request in the engine")
    del lines  # the connection closes: the client is gone
    wait_until(lambda: front.worker.aborted() == aborted + 1, "the engine to abort the request")
    wait_until(lambda: front.worker.load() == 0, "the engine to hold no request")
