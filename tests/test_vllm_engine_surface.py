"""The OpenAI surface on our worker with `--engine vllm`, end to end through the gateway
with the official openai SDK: forced tool calls (guided decoding of vLLM's own schemas)
whose arguments validate against their schemas, `response_format`, logprobs, n choices
(vLLM's parallel sampling), the extra sampling fields (min_tokens, ignore_eos,
logit_bias, stop_token_ids ... shown with a logit bias that makes the end of sequence
or one token certain), refusals naming their parameter, and a second worker on the
same tiny model as an embedding model (vLLM's pooling runner).

The tiny model has random weights: its text is junk, so the tests check shapes,
counts, finish reasons and what guided decoding guarantees, never what it "says".
Schemas stay bounded (enums, booleans): a free string or integer can run on to
`max_tokens` on a random model.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from gateway.protocol import features
from gateway.protocol.convert import event_from_proto, request_to_proto
from gateway.protocol.types import Finished, GenerateRequest, SamplingParams, Started, Text
from gateway.protocol.v1 import engine_pb2_grpc
from tests.support.requests import opened, user
from tests.support.servers import ServerLoop, Workers, assert_nothing_left
from tests.support.surface import MAX_TOKENS, SCHEMAS, TOOLS, assert_valid, calls_of
from tests.support.vllm import MAX_MODEL_LEN, START_GUARD, vllm_python
from tests.support.vllm_worker import (
    EMBED_MODEL,
    EMBED_OPTIONS,
    MODEL,
    Front,
    VllmWorker,
    open_front,
    start_vllm_worker,
)
from tests.support.waiting import wait_until

#: The first test waits for both workers to start (vLLM's import, then each engine).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2 * START_GUARD + 60)]

MESSAGES = user("what is the weather in paris")
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
#: vLLM's hidden size of the tiny model: the length of its embeddings.
HIDDEN = 256


@pytest.fixture(scope="module")
def embed_worker(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmWorker]:
    """The tiny model as an embedding model, in a worker of its own."""
    began = time.monotonic()
    worker = start_vllm_worker(
        vllm_model, tmp_path_factory.mktemp("vllm-embed-logs"), *EMBED_OPTIONS, name=EMBED_MODEL
    )
    print(f"the embedding worker started in {time.monotonic() - began:.1f} s")
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def front(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_worker: VllmWorker,
    embed_worker: VllmWorker,
    vllm_model: Path,
) -> Iterator[Front]:
    more = {EMBED_MODEL: embed_worker}
    with open_front(server_loop, workers, vllm_worker, vllm_model, more) as opened:
        yield opened


@pytest.fixture(autouse=True)
def _nothing_left(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "front" not in request.fixturenames:  # a test without the workers
        return
    front = request.getfixturevalue("front")
    assert_nothing_left(front.gateway, None)
    for worker in (front.worker, request.getfixturevalue("embed_worker")):
        wait_until(lambda w=worker: w.load() == 0, "the engines to hold no request")


def _chat(front: Front, **body: Any) -> Any:
    return front.sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **body)


def _stream(front: Front, **body: Any) -> list[Any]:
    return list(_chat(front, stream=True, stream_options={"include_usage": True}, **body))


def _refusal(front: Front, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = front.http.post(path, json=body)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def _validate(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# -- what the workers serve -----------------------------------------------------------


def test_the_workers_list_what_their_models_serve(front: Front, embed_worker: VllmWorker):
    (generating,) = front.worker.describe().models
    assert set(generating.features) == {
        features.GENERATE,
        features.N,
        features.LOGPROBS,
        features.TOOLS,
        features.RESPONSE_FORMAT,
        features.MIN_TOKENS,
        features.IGNORE_EOS,
        features.REPETITION_PENALTY,
        features.MIN_P,
        features.LOGIT_BIAS,
        features.STOP_TOKEN_IDS,
        features.USER,
        features.REASONING_EFFORT,
        features.CHAT_TEMPLATE_KWARGS,
        features.TOKENIZE,  # Tokenize and Detokenize
        *features.STRUCTURED,  # vLLM's structured outputs: regex, choice, grammar
        *features.CHAT_END,  # a prefill, a chat without its generation prompt
        features.INCLUDE_STOP,  # the SDK matches the stop strings
        features.SKIP_SPECIAL_TOKENS,  # vLLM's detokenizer shows them when asked
        features.TRUNCATE_PROMPT_TOKENS,  # the ids it renders, cut
        features.RETURN_TOKEN_IDS,  # the prompt's ids it ran, each step's sampled ids
    }  # no image_url: the tiny model is not multimodal; no reasoning parser runs
    (embedding,) = embed_worker.describe().models
    # no dimensions: the model is not a Matryoshka one; no generate: it pools
    assert set(embedding.features) == {features.EMBEDDINGS, features.USER, features.TOKENIZE}
    assert embedding.max_context == generating.max_context


# -- tool calls -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_tool_choice_calls_that_function_with_valid_arguments(
    front: Front, name: str, stream: bool
):
    choice = {"type": "function", "function": {"name": name}}
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}
    calls, finish = calls_of(front.sdk, {**body, "max_tokens": MAX_TOKENS}, stream)
    assert_valid(calls)
    assert [call.name for call in calls] == [name]
    assert all(call.id.startswith("call_") for call in calls)
    assert finish == "stop"  # OpenAI's reason for a call of a named function


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_without_parallel_calls_makes_one_valid_call(
    front: Front, stream: bool
):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": MAX_TOKENS,
        "temperature": 1,
    }
    calls, finish = calls_of(front.sdk, body, stream)
    assert_valid(calls)
    assert len(calls) == 1
    assert finish == "tool_calls"


def test_required_tool_choice_calls_in_every_choice(front: Front):
    reply = _chat(front, tools=TOOLS, tool_choice="required", n=2, max_tokens=160, seed=7)
    assert [c.index for c in reply.choices] == [0, 1]
    for answer in reply.choices:
        # a random model may go on adding calls until max_tokens cuts the array
        assert answer.finish_reason in ("tool_calls", "length")
        assert answer.message.tool_calls
        for call in answer.message.tool_calls:
            _validate(call.function.name, call.function.arguments)


def test_auto_tool_choice_on_a_model_that_writes_no_call_answers_text(front: Front):
    reply = _chat(front, tools=TOOLS, tool_choice="auto", max_tokens=12, temperature=0)
    (answer,) = reply.choices
    assert answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0
    # "none" renders no tools: the answer is the one without tools
    none = _chat(front, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    plain = _chat(front, max_tokens=12, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


#: Feeds a model's text through vLLM's own parser of a format the gateway has none of
#: (pythonic: `[f(x=1), g()]`), behind our parser interface, as the engine does for
#: `tool_choice` "auto"; prints each case's events as JSON.
VLLM_PARSER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    from transformers import AutoTokenizer
    from vllm.tool_parsers import ToolParserManager
    from gateway.protocol.tool_calls import ChoiceToolCalls
    from gateway.protocol.types import GenerateRequest, Message, Tool
    from gateway.worker.vllm_engine import _VllmParser

    engine = SimpleNamespace(
        model="m",
        tokenizer=AutoTokenizer.from_pretrained(sys.argv[1]),
        parser_class=ToolParserManager.get_tool_parser("pythonic"),
    )
    tools = tuple(Tool(name, parameters=json.dumps(schema))
                  for name, schema in json.loads(sys.argv[2]).items())
    out = []
    for text, parallel in json.loads(sys.argv[3]):
        request = GenerateRequest("m", messages=(Message("user", "hi"),), tools=tools,
                                  parallel_tool_calls=parallel)
        parser = _VllmParser(request, engine, _VllmParser.chat_request(request, engine))
        choice, events = ChoiceToolCalls(parser), []
        for start in range(0, len(text), 3):  # 3 characters a token
            parser.ids([0])
            events += choice.feed(text[start : start + 3], 1)
        events += choice.finish()
        out.append([[type(e).__name__, *e] for e in events])
    print(json.dumps(out))
    """
)


def test_vllms_own_tool_parsers_stream_calls_through_ours(vllm_model: Path):
    calls = '[get_weather(city="Oslo", celsius=True), get_time(zone="UTC")]'
    cases = [[calls, None], [calls, False], ["no call here", None]]
    done = subprocess.run(
        [
            str(vllm_python()),
            "-c",
            VLLM_PARSER_SCRIPT,
            str(vllm_model),
            json.dumps(SCHEMAS),
            json.dumps(cases),
        ],
        capture_output=True,
        text=True,
        timeout=START_GUARD,
        check=True,
    )
    parallel, single, text = json.loads(done.stdout.splitlines()[-1])

    def joined(events: list[list[Any]]) -> list[tuple[str, str]]:
        found: list[list[str]] = []
        for kind, _, call, call_id, name, arguments, *_ in events:
            assert kind == "ToolCallDelta"
            if call_id:  # a call opens with its id and name, then its arguments
                assert call == len(found) and call_id.startswith("call_") and name
                found.append([name, ""])
            found[call][1] += arguments
        return [(name, arguments) for name, arguments in found]

    assert [name for name, _ in joined(parallel)] == ["get_weather", "get_time"]
    for name, arguments in joined(parallel):
        _validate(name, arguments)
    assert [name for name, _ in joined(single)] == ["get_weather"]  # no parallel calls
    assert "".join(e[1] for e in text) == "no call here"
    assert sum(e[2] for e in text) == 4  # every token counted


def test_a_forced_call_with_a_response_format_is_refused(front: Front):
    error = _refusal(
        front,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    )
    assert error["param"] == "response_format"


# -- response_format --------------------------------------------------------------------


def test_a_json_schema_response_format_is_followed(front: Front):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    reply = _chat(front, response_format=fmt, max_tokens=64, temperature=1)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER)

    chunks = _stream(front, response_format=fmt, max_tokens=64, temperature=1)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), ANSWER)


def test_a_json_object_response_format_answers_an_object(front: Front):
    reply = _chat(front, response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    content = reply.choices[0].message.content
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":  # else max_tokens cut the object
        assert isinstance(json.loads(content), dict)


# -- logprobs ---------------------------------------------------------------------------


def test_chat_logprobs_give_each_token_its_top_alternatives(front: Front):
    reply = _chat(front, logprobs=True, top_logprobs=3, max_tokens=6, temperature=0)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy takes the top one

    chunks = _stream(front, logprobs=True, top_logprobs=3, max_tokens=6, temperature=0)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]

    without = _chat(front, logprobs=True, max_tokens=3, temperature=0)  # top_logprobs 0
    assert [e.top_logprobs for e in without.choices[0].logprobs.content] == [[], [], []]


def test_completion_logprobs_in_the_legacy_shape(front: Front):
    reply = front.sdk.completions.create(
        model=MODEL, prompt="one two three", logprobs=2, max_tokens=5, temperature=0
    )
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(value <= 0 for value in logprobs.token_logprobs)
    # one entry per alternative, fewer where two decode alike (a dict by token text)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)


# -- n choices ----------------------------------------------------------------------------


def test_n_choices_come_indexed_and_their_tokens_summed(front: Front):
    reply = _chat(front, n=2, max_tokens=8, temperature=1, seed=3)
    assert [(c.index, c.finish_reason) for c in reply.choices] == [(0, "length"), (1, "length")]
    assert reply.usage.completion_tokens == 16

    chunks = _stream(front, n=2, max_tokens=8, temperature=1, seed=3)
    ended = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in chunks
        if c.choices and c.choices[0].finish_reason
    }
    assert ended == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 16
    texts = [
        "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == i
        )
        for i in (0, 1)
    ]
    # the same seed samples the same choices again
    assert texts == [c.message.content for c in reply.choices]


def test_n_choices_over_the_worker_protocol(front: Front):
    """vLLM's parallel sampling as the worker sends it: one Started, each choice's
    pieces with its index, one Finished per choice with its own count."""
    request = GenerateRequest(
        MODEL, prompt="one two three", n=3, logprobs=1, sampling=SamplingParams(max_tokens=5)
    )
    aborted = front.worker.aborted()
    with grpc.insecure_channel(f"127.0.0.1:{front.worker.port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        events = [
            event_from_proto(m, details=True)
            for m in stub.Generate(request_to_proto(request), timeout=60)
        ]
    assert type(events[0]) is Started
    finished = [e for e in events if type(e) is Finished]
    assert sorted((e.index, e.reason.value, e.completion_tokens) for e in finished) == [
        (i, "length", 5) for i in range(3)
    ]
    for i in range(3):
        texts = [e for e in events if type(e) is Text and e.index == i]
        assert sum(e.tokens for e in texts) == 5
        assert sum(len(e.logprobs or ()) for e in texts) == 5
    assert type(events[-1]) is Finished
    wait_until(lambda: front.worker.load() == 0, "the engine to hold no request")
    assert front.worker.aborted() == aborted  # a finished request is not aborted


def test_greedy_choices_are_one_answer_given_n_times(front: Front):
    # vLLM refuses n > 1 at temperature 0; the worker generates once and copies it
    reply = _chat(front, n=3, max_tokens=6, temperature=0, logprobs=True)
    one = _chat(front, max_tokens=6, temperature=0, logprobs=True).choices[0]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} == {one.message.content}
    assert all(len(c.logprobs.content) == 6 for c in reply.choices)
    assert reply.usage.completion_tokens == 18


def test_a_client_that_leaves_n_choices_aborts_them_all_in_the_engine(front: Front):
    aborted = front.worker.aborted()
    body = {"model": MODEL, "prompt": "one two three", "n": 3, "stream": True}
    body |= {"max_tokens": MAX_MODEL_LEN - 64, "temperature": 1, "seed": 1}
    with front.http.stream("POST", "/v1/completions", json=body) as response:
        lines = opened(response)
        next(lines)
        # vLLM holds the 3 choices as 3 requests; the worker aborts them by their parent's id
        wait_until(lambda: front.worker.load() == 3, "the 3 choices in the engine")
    del lines  # the connection closes: the client is gone
    wait_until(lambda: front.worker.aborted() == aborted + 1, "the engine to abort the request")
    wait_until(lambda: front.worker.load() == 0, "the engine to hold no choice")


# -- sampling fields ------------------------------------------------------------------------


def test_min_tokens_hold_off_an_end_of_sequence_made_certain(front: Front):
    eos = front.tokenizer.eos_token_id
    bias = {str(eos): 100}
    at_once = _chat(front, logit_bias=bias, max_tokens=32, temperature=0)
    assert (at_once.choices[0].finish_reason, at_once.usage.completion_tokens) == ("stop", 1)
    held = _chat(
        front, logit_bias=bias, max_tokens=32, temperature=0, extra_body={"min_tokens": 10}
    )
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 11)
    ignored = _chat(
        front, logit_bias=bias, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 6)


def test_stop_token_ids_end_the_answer_at_that_token(front: Front):
    token = front.tokenizer.encode("fox", add_special_tokens=False)[0]
    bias = {str(token): 100}  # every token is that one
    running = _chat(front, logit_bias=bias, max_tokens=4, temperature=0)
    assert (running.choices[0].finish_reason, running.usage.completion_tokens) == ("length", 4)
    stopped = _chat(
        front, logit_bias=bias, max_tokens=4, temperature=0, extra_body={"stop_token_ids": [token]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1


def test_the_other_sampling_fields_and_user_are_taken(front: Front):
    reply = _chat(
        front,
        max_tokens=4,
        seed=5,
        user="team-search-42",
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05},
    )
    assert reply.usage.completion_tokens == 4


def test_the_template_takes_the_reasoning_options_and_the_rest_are_refused(front: Front):
    # the tiny model's template reads neither: its prompt is the same, and served
    plain = _chat(front, max_tokens=1)
    for extra in (
        {"reasoning_effort": "none"},
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": True}},
        {"chat_template_kwargs": {"tokenize": True}},  # the engine's own argument stays its own
    ):
        served = _chat(front, max_tokens=1, extra_body=extra)
        assert served.usage.prompt_tokens == plain.usage.prompt_tokens, extra
    for field, value in (("include_reasoning", False), ("thinking_token_budget", 8)):
        body = {"model": MODEL, "messages": MESSAGES, field: value}
        assert _refusal(front, "/v1/chat/completions", body)["param"] == field


def test_what_vllm_refuses_is_a_400_naming_the_parameter(front: Front):
    body = {"model": MODEL, "messages": MESSAGES, "logit_bias": {"99999": 5}}
    assert _refusal(front, "/v1/chat/completions", body)["param"] == "logit_bias"
    body = {"model": MODEL, "messages": MESSAGES, "stop_token_ids": [99999]}
    assert _refusal(front, "/v1/chat/completions", body)["param"] == "stop_token_ids"
    # a schema by the metaschema (the edge refuses what is not one) that vLLM cannot compile
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}
    body = {"model": MODEL, "messages": MESSAGES, "response_format": fmt}
    assert _refusal(front, "/v1/chat/completions", body)["param"] == "response_format"


def test_an_image_is_refused_by_a_model_without_images(front: Front):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}],
    }
    assert _refusal(front, "/v1/chat/completions", body)["param"].startswith("messages")


# -- embeddings ---------------------------------------------------------------------------------


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


def _close(a: Any, b: Any, tolerance: float) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < tolerance


def test_the_pooling_worker_embeds_texts_and_token_ids(front: Front):
    texts = ["hello from the fleet", "the quick brown fox"]
    reply = front.sdk.embeddings.create(model=EMBED_MODEL, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1]
    vectors = [d.embedding for d in reply.data]
    assert [len(v) for v in vectors] == [HIDDEN, HIDDEN]
    assert all(abs(_norm(v) - 1) < 1e-3 for v in vectors)  # vLLM normalizes them
    assert vectors[0] != vectors[1]
    ids = [front.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert reply.usage.prompt_tokens == sum(len(i) for i in ids)

    by_ids = front.sdk.embeddings.create(model=EMBED_MODEL, input=ids, encoding_format="float")
    for ours, theirs in zip(by_ids.data, reply.data, strict=True):
        assert _close(ours.embedding, theirs.embedding, 1e-3)

    raw = front.http.post(
        "/v1/embeddings",
        json={"model": EMBED_MODEL, "input": texts[0], "encoding_format": "base64"},
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert len(packed) == 4 * HIDDEN
    decoded = struct.unpack(f"<{HIDDEN}f", packed)
    assert _close(decoded, vectors[0], 1e-6)


def test_the_pooling_worker_tokenizes_and_detokenizes_as_vllms_server(front: Front):
    """vLLM's server tokenizes for a pooling model too: its /tokenize gives the
    tokenizer's ids of a text (special tokens added, as vLLM adds them by default), and
    /detokenize its text back."""
    text = "the quick brown fox"
    tokens = front.http.post("/tokenize", json={"model": EMBED_MODEL, "prompt": text})
    assert tokens.status_code == 200, tokens.text
    ids = front.tokenizer.encode(text)
    assert tokens.json()["tokens"] == ids
    assert tokens.json()["count"] == len(ids)
    back = front.http.post("/detokenize", json={"model": EMBED_MODEL, "tokens": ids})
    assert back.status_code == 200, back.text
    assert back.json()["prompt"] == front.tokenizer.decode(ids, skip_special_tokens=False)


def test_each_model_refuses_the_others_route(front: Front):
    body = {"model": EMBED_MODEL, "input": "hello", "dimensions": 8}
    assert _refusal(front, "/v1/embeddings", body)["param"] == "dimensions"
    _refusal(front, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    _refusal(front, "/v1/chat/completions", {"model": EMBED_MODEL, "messages": MESSAGES})
    with pytest.raises(openai.BadRequestError):
        front.sdk.completions.create(model=EMBED_MODEL, prompt="hello", max_tokens=2)


def test_an_input_longer_than_the_context_is_context_length_exceeded(front: Front):
    words = "one two three four " * 400
    error = _refusal(front, "/v1/embeddings", {"model": EMBED_MODEL, "input": ["hi", words]})
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
