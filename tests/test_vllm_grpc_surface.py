"""The OpenAI surface on vLLM's own gRPC server (`upstream: vllm-grpc`), end to end:
stock vLLM (its CPU build, the tiny random model), the real gateway, the openai SDK.

Two models share the one engine: `tiny-vllm-tools` has a tokenizer directory whose
chat template shows the model its tools and writes calls as Hermes' `<tool_call>`
(`tool_call_parser: hermes`); `tiny-vllm-plain` has the model's own template, which
reads no tools. A random model's text is junk: guided decoding (xgrammar, the
server's structured-outputs setting) is what makes its JSON and tool arguments
valid, so the schemas are bounded (enums, booleans) and finish in a few tokens.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from gateway.protocol import features
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
    Text,
)
from gateway.tokenization import load_tokenizer
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from tests.support import fronts
from tests.support.fronts import front_over, grpc_model, nothing_left_after_each
from tests.support.requests import user
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left
from tests.support.surface import (
    MAX_TOKENS,
    TOOLS,
    WEATHER,
    Call,
    assert_valid,
    calls_of,
)
from tests.support.tiny_model import tools_tokenizer
from tests.support.vllm import VllmProcess, start_grpc_server
from tests.support.vllm_worker import EMBED_MODEL, EMBED_OPTIONS
from tests.support.waiting import HANG_GUARD

#: The session's vLLM server starts in the first test's setup and stops in the last one's
#: teardown (20-30 s each on 2 busy cores): past the default 60 s, pytest-timeout would
#: cut the stop short and leave the server running.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

TOOLS_MODEL = "tiny-vllm-tools"
PLAIN = "tiny-vllm-plain"


@dataclass
class Front(fronts.Front):
    tools_dir: Path


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_grpc: VllmProcess,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Front]:
    tools_dir = tools_tokenizer(vllm_model, tmp_path_factory.mktemp("tools-tokenizer"))
    models = (
        grpc_model(TOOLS_MODEL, vllm_grpc, tools_dir, tool_call_parser="hermes"),
        grpc_model(PLAIN, vllm_grpc, vllm_model),
    )
    with front_over(server_loop, models, workers) as shared:
        yield Front(shared.gateway, shared.sdk, shared.claude, tools_dir)


_nothing_left = nothing_left_after_each()


def _assert_valid(calls: list[Call]) -> None:
    assert_valid(calls)
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)


def _chat(front: Front, **body: Any) -> Any:
    return front.sdk.chat.completions.create(**{"model": PLAIN, "temperature": 0, **body})


def test_the_engine_says_what_it_serves(server_loop: ServerLoop, front: Front, vllm_grpc):
    address = f"127.0.0.1:{vllm_grpc.port}"

    async def described(**fields: Any) -> tuple[frozenset[str], frozenset[str]]:
        upstream = VllmGrpcUpstream(address, model="m", tokenizer=str(front.tools_dir), **fields)
        try:
            (model,) = await upstream.describe(HANG_GUARD)
            embedder = upstream.features(pb.GetModelInfoResponse(is_generation=False))
            return model.features, embedder
        finally:
            await upstream.close()

    served, embedder = server_loop.call(described(tool_call_parser="hermes"))
    assert {"tools", "n", "logprobs", "response_format", "logit_bias", "tokenize"} <= served
    assert {"image_url", "embeddings", "dimensions"}.isdisjoint(served)
    # the chat form of embeddings too: the gateway renders it with the model's template
    assert embedder == {
        features.EMBEDDINGS,
        features.USER,
        features.TOKENIZE,
        features.EMBEDDING_CHAT,
    }
    served, _ = server_loop.call(described())
    assert "tools" not in served  # no call format configured
    assert front.sdk.models.retrieve(TOOLS_MODEL).id == TOOLS_MODEL


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_calls_follow_their_schemas(front: Front, stream: bool, seed: int):
    body = {
        "model": TOOLS_MODEL,
        "messages": user("what is the weather in Paris"),
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
    }
    # A random model may go on adding calls to the array until max_tokens cuts it:
    # the calls that closed are served, the cut one is the text it was.
    calls, finish = calls_of(front.sdk, body, stream)
    _assert_valid(calls)
    assert finish in ("tool_calls", "length")
    single, finish = calls_of(front.sdk, {**body, "parallel_tool_calls": False}, stream)
    _assert_valid(single)
    assert len(single) == 1 and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_is_the_one_called(front: Front, stream: bool):
    body = {
        "model": TOOLS_MODEL,
        "messages": user("what time is it"),
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    calls, finish = calls_of(front.sdk, body, stream)
    _assert_valid(calls)
    assert [call.name for call in calls] == ["get_time"]
    assert finish == "stop"  # a named call stops (OpenAI's and vLLM's reason)


def _prompt_tokens(front: Front, **body: Any) -> int:
    return _chat(front, model=TOOLS_MODEL, max_tokens=1, **body).usage.prompt_tokens


def test_the_template_shows_tools_as_transformers_renders_them(front: Front):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(front.tools_dir))
    messages = user("hello")
    plain = _prompt_tokens(front, messages=messages)
    expected = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _prompt_tokens(front, messages=messages, tools=TOOLS) == len(expected) > plain
    assert _prompt_tokens(front, messages=messages, tools=TOOLS, tool_choice="none") == plain

    # a call answered, and the conversation goes on: the template gets its arguments parsed
    first = _chat(
        front,
        model=TOOLS_MODEL,
        messages=user("weather please"),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    answer = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    messages = [*user("weather please"), first.choices[0].message.model_dump(), answer]
    rendered = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
            ],
        },
        answer,
    ]
    expected = tokenizer.apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert _prompt_tokens(front, messages=messages, tools=TOOLS) == len(expected)


def test_auto_on_a_random_model_answers_text(front: Front):
    reply = _chat(front, model=TOOLS_MODEL, messages=user("hello"), tools=TOOLS, max_tokens=8)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tools_without_a_call_format_are_a_bad_request(front: Front):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(front, messages=user("x"), tools=TOOLS)
    assert refused.value.body["param"] == "tools"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_validates(front: Front, stream: bool):
    body = {
        "messages": user("describe the weather as JSON"),
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": MAX_TOKENS,
    }
    if stream:
        chunks = list(_chat(front, **body, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = _chat(front, **body).choices[0]
        text, finish = choice.message.content or "", choice.finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_mode_answers_an_object_or_runs_out(front: Front):
    choice = _chat(
        front,
        messages=user("any JSON object"),
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
    ).choices[0]
    assert choice.message.content.startswith("{")
    if choice.finish_reason == "stop":  # else max_tokens cut it inside the object
        assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_have_one_entry_a_token_and_the_alternatives_asked(
    front: Front, stream: bool
):
    body = {
        "messages": user("hello from the fleet"),
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 6,
        "extra_body": {"ignore_eos": True},
    }
    if stream:
        chunks = list(_chat(front, **body, stream=True, stream_options={"include_usage": True}))
        entries = [
            entry
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for entry in c.choices[0].logprobs.content or []
        ]
        tokens = chunks[-1].usage.completion_tokens
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        reply = _chat(front, **body)
        entries = reply.choices[0].logprobs.content
        tokens = reply.usage.completion_tokens
        text = reply.choices[0].message.content
    assert len(entries) == tokens == 6
    # each token named by its own text; the first bytes of a character the answer ends in
    # are not in its text (vLLM's server drops them) but their tokens have their entries
    named = "".join(entry.token for entry in entries)
    assert named == text or (named.startswith(text) and named.endswith("\ufffd"))
    for entry in entries:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy takes the likeliest


def test_completion_logprobs_take_an_integer(front: Front):
    reply = front.sdk.completions.create(
        model=PLAIN,
        prompt="the quick brown fox",
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)


def test_n_choices_come_in_one_stream_each_with_its_own_end(
    server_loop: ServerLoop, vllm_grpc, vllm_model: Path
):
    """In the order vLLM sends them: interleaved a step at a time when the stream keeps up
    with the engine, but a slow reader's steps of a choice merge into one message (vLLM's
    output collector), so on a loaded machine the choices may come one after another.
    That the gateway relays them in the engine's order, holding none behind another, is
    checked against a stand-in that interleaves them (tests/test_vllm_grpc_choices.py)."""

    async def events() -> list[Event]:
        upstream = VllmGrpcUpstream(
            f"127.0.0.1:{vllm_grpc.port}", model="m", tokenizer=str(vllm_model)
        )
        sampling = SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
        request = GenerateRequest("m", messages=(Message("user", "hello"),), n=3, sampling=sampling)
        try:
            return [event async for event in upstream.call(request, HANG_GUARD)]
        finally:
            await upstream.close()

    out = server_loop.call(events())
    assert isinstance(out[0], Started) and out[0].prompt_tokens > 0
    assert not any(isinstance(e, Started) for e in out[1:])
    finished = [e for e in out if isinstance(e, Finished)]
    assert sorted(e.index for e in finished) == [0, 1, 2]
    assert all(e.reason is FinishReason.LENGTH and e.completion_tokens == 5 for e in finished)
    for index in range(3):
        # the tokens of a character's first bytes the answer ends in have no text (vLLM's
        # server drops it): its Finished alone counts them
        tokens = [e.tokens for e in out if isinstance(e, Text) and e.index == index]
        assert 0 < sum(tokens) <= 5
        # its own end comes after its text, and nothing of it after that
        end = next(i for i, e in enumerate(out) if isinstance(e, Finished) and e.index == index)
        assert not any(getattr(e, "index", None) == index for e in out[end + 1 :])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_each_end_and_usage_is_their_sum(front: Front, stream: bool):
    body = {
        "messages": user("hello"),
        "n": 2,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 5,
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        reply = _chat(front, **body)
        assert [c.index for c in reply.choices] == [0, 1]
        assert [c.finish_reason for c in reply.choices] == ["length", "length"]
        assert reply.usage.completion_tokens == 10
        return
    chunks = list(_chat(front, **body, stream=True, stream_options={"include_usage": True}))
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage.completion_tokens == 10


def test_continuous_usage_counts_the_engines_prompt_and_each_token(front: Front):
    # vLLM's `continuous_usage_stats`: the prompt as the gateway tokenized it for the
    # engine, and the tokens so far, in every chunk; the finish chunk has them all
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"messages": user("hello"), "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    *content, last = list(_chat(front, **body, stream=True, stream_options=options))
    prompt_tokens = _chat(front, messages=user("hello"), max_tokens=1).usage.prompt_tokens
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_tokens, 6)
    counts = [chunk.usage.completion_tokens for chunk in content]
    assert all(chunk.usage.prompt_tokens == last.usage.prompt_tokens for chunk in content)
    assert counts[0] == 0  # the role's opening
    assert counts == sorted(counts) and counts[-1] == 6
    assert content[-1].choices[0].finish_reason == "length"


def test_min_tokens_holds_the_end_back(front: Front):
    reply = _chat(front, messages=user("hi"), max_tokens=24, extra_body={"min_tokens": 24})
    assert reply.usage.completion_tokens == 24
    assert reply.choices[0].finish_reason == "length"
    # a stop string cuts only the text past min_tokens, as in vLLM (id 0 is "a": every token)
    stopped = _chat(
        front,
        messages=user("hi"),
        max_tokens=8,
        stop=["a"],
        logit_bias={"0": 100},
        extra_body={"min_tokens": 3},
    )
    assert stopped.choices[0].message.content == "aaa"
    assert stopped.choices[0].finish_reason == "stop"


def test_logit_bias_and_stop_token_ids_reach_the_engine(front: Front, vllm_model: Path):
    # id 0 is "a" in the tiny vocabulary: a bias of 100 makes it every token
    biased = _chat(front, messages=user("hi"), max_tokens=4, logit_bias={"0": 100})
    assert biased.choices[0].message.content == "aaaa"
    stopped = _chat(
        front,
        messages=user("hi"),
        max_tokens=4,
        logit_bias={"0": 100},
        extra_body={"stop_token_ids": [0]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == ""  # the stop token is not shown
    sampled = _chat(
        front,
        messages=user("hi"),
        max_tokens=4,
        temperature=1.0,
        seed=11,
        user="team-a",
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05},
    )
    again = _chat(
        front,
        messages=user("hi"),
        max_tokens=4,
        temperature=1.0,
        seed=11,
        user="team-a",
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05},
    )
    assert sampled.choices[0].message.content == again.choices[0].message.content


def test_refusals_name_their_parameter(front: Front):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(front, messages=[{"role": "user", "content": [image, {"type": "text", "text": "x"}]}])
    assert refused.value.body["param"].startswith("messages[0]")
    assert "image_url" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(front, messages=user("x"), seed=2**40, max_tokens=2)
    assert refused.value.body["param"] == "seed"


@pytest.fixture(scope="module")
def embed_front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Gateway, openai.OpenAI, VllmProcess]]:
    """The tiny model as an embedding model (vLLM's pooling runner) behind its own
    gateway: a second engine, started only for these tests."""
    logs = tmp_path_factory.mktemp("embed-logs")
    with start_grpc_server(vllm_model, logs, EMBED_OPTIONS) as engine:
        model = grpc_model(EMBED_MODEL, engine, vllm_model)
        with front_over(server_loop, (model,), workers) as shared:
            yield shared.gateway, shared.sdk, engine


@pytest.mark.timeout(300)  # a second engine starts (~40 s) and stops with this test
def test_an_embedding_engine_embeds_texts_and_token_ids(embed_front, vllm_model: Path):
    gw, sdk, engine = embed_front
    texts = ["the quick brown fox", "hello from the fleet"]
    reply = sdk.embeddings.create(model=EMBED_MODEL, input=texts)
    vectors = [item.embedding for item in reply.data]
    assert [item.index for item in reply.data] == [0, 1]
    assert len(vectors[0]) == len(vectors[1]) > 0 and vectors[0] != vectors[1]
    tokenizer = load_tokenizer(str(vllm_model))
    ids = [tokenizer.encode(text, add_special_tokens=True) for text in texts]
    assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
    # the same ids straight to the engine's Embed: the same vector
    with grpc.insecure_channel(f"127.0.0.1:{engine.port}") as channel:
        direct = pb_grpc.VllmEngineStub(channel).Embed(
            pb.EmbedRequest(request_id="direct", tokenized=pb.TokenizedInput(input_ids=ids[0])),
            timeout=HANG_GUARD,
        )
    assert vectors[0] == pytest.approx(list(direct.embedding), rel=1e-5)
    by_ids = sdk.embeddings.create(model=EMBED_MODEL, input=ids[0])
    assert by_ids.data[0].embedding == pytest.approx(vectors[0], rel=1e-5)
    assert sdk.embeddings.create(model=EMBED_MODEL, input=texts[0], user="team-a").data
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model=EMBED_MODEL, input="x", dimensions=8)
    assert refused.value.body["param"] == "dimensions"
    assert_nothing_left(gw, None)
