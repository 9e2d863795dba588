"""Every validation rule: a 400 invalid_request_error naming the parameter."""

from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from gateway.config import ModelConfig
from gateway.protocol import features
from gateway.protocol.types import Event, GenerateRequest
from gateway.worker.demo import DemoEngine
from tests.support.waiting import HANG_GUARD

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello world"}]


def called(*ids: str) -> list[dict]:
    """An assistant message calling a tool once for each id."""
    calls = [
        {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids
    ]
    return [{"role": "assistant", "content": None, "tool_calls": calls}]


def answer(call_id: str) -> dict:
    """A tool message answering the call `call_id`."""
    return {"role": "tool", "content": "42", "tool_call_id": call_id}


def chat(**fields):
    return {"model": "furnace-demo", "messages": MESSAGES, **fields}


def completion(**fields):
    return {"model": "furnace-demo", "prompt": "hello world", **fields}


INVALID = [
    # (route, body, param)
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=129), "n"),
    (CHAT, chat(n="1"), "n"),
    (COMPLETIONS, completion(best_of=2), "best_of"),
    (CHAT, chat(best_of=2), "best_of"),
    (CHAT, chat(echo=1), "echo"),  # vLLM's chat echo is served: a boolean
    (CHAT, chat(skip_special_tokens="no"), "skip_special_tokens"),
    (COMPLETIONS, completion(skip_special_tokens=0), "skip_special_tokens"),
    (CHAT, chat(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (CHAT, chat(suffix="tail"), "suffix"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(logprobs="yes"), "logprobs"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (COMPLETIONS, completion(logprobs=True), "logprobs"),
    (COMPLETIONS, completion(echo=True, logprobs=1), "echo"),
    (CHAT, chat(tools=[{"type": "retrieval"}]), "tools[0].type"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        "tools[0].function.name",
    ),
    (CHAT, chat(tools={"type": "function"}), "tools"),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        "tools[0].function.parameters",
    ),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tool_choice",
    ),
    (
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="any"),
        "tool_choice",
    ),
    (CHAT, chat(response_format={"type": "xml"}), "response_format"),
    (CHAT, chat(response_format="text"), "response_format"),
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        "response_format.json_schema.name",
    ),
    (CHAT, chat(functions=[{"name": "f"}]), "functions"),
    (CHAT, chat(guided_json={"type": "object"}), "guided_json"),
    # vLLM 0.32's newer options, which asked for something and were dropped without a word
    (CHAT, chat(request_id="mine"), "request_id"),
    (CHAT, chat(stream_interval=0), "stream_interval"),  # served: an integer of at least 1
    (CHAT, chat(return_token_offsets=True), "return_token_offsets"),
    (COMPLETIONS, completion(truncation_side="left"), "truncation_side"),
    (COMPLETIONS, completion(repetition_detection={"n": 3}), "repetition_detection"),
    # vLLM's structured outputs: one constraint, checked and bounded
    (CHAT, chat(structured_outputs="x"), "structured_outputs"),
    (CHAT, chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs.choice"),
    (CHAT, chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (CHAT, chat(structured_outputs={"choice": ["a", ""]}), "structured_outputs.choice"),
    (CHAT, chat(structured_outputs={"choice": ["a"] * 1025}), "structured_outputs.choice"),
    (CHAT, chat(structured_outputs={"regex": ""}), "structured_outputs.regex"),
    (CHAT, chat(structured_outputs={"regex": "a" * 65537}), "structured_outputs.regex"),
    (CHAT, chat(structured_outputs={"grammar": 5}), "structured_outputs.grammar"),
    (CHAT, chat(structured_outputs={"json": "{"}), "structured_outputs.json"),
    (CHAT, chat(structured_outputs={"json": [1]}), "structured_outputs.json"),
    (CHAT, chat(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
    (CHAT, chat(structured_outputs={"tags": 1}), "structured_outputs.tags"),
    (
        CHAT,
        chat(structured_outputs={"choice": ["a"], "disable_any_whitespace": True}),
        "structured_outputs.disable_any_whitespace",
    ),
    (
        CHAT,
        chat(structured_outputs={"choice": ["a"]}, response_format={"type": "json_object"}),
        "structured_outputs",
    ),
    (
        CHAT,
        chat(
            structured_outputs={"choice": ["a"]},
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
        ),
        "structured_outputs",
    ),
    # the demo's workers list `choice` only
    (CHAT, chat(structured_outputs={"regex": "[a-z]+"}), "structured_outputs.regex"),
    (
        COMPLETIONS,
        completion(structured_outputs={"grammar": 'root ::= "a"'}),
        "structured_outputs.grammar",
    ),
    (CHAT, chat(use_beam_search=True), "use_beam_search"),
    (CHAT, chat(return_tokens_as_token_ids=True), "return_tokens_as_token_ids"),
    (CHAT, chat(priority=5), "priority"),
    (CHAT, chat(store=True), "store"),
    (CHAT, chat(service_tier="flex"), "service_tier"),
    (CHAT, chat(moderation={"input": True}), "moderation"),
    (CHAT, chat(prompt_cache_retention="24h"), "prompt_cache_retention"),
    (CHAT, chat(prompt_cache_options={"ttl": "1h"}), "prompt_cache_options"),
    (CHAT, chat(verbosity="low"), "verbosity"),
    (CHAT, chat(vllm_xargs={"a": 1}), "vllm_xargs"),
    (CHAT, chat(add_special_tokens=True), "add_special_tokens"),
    (COMPLETIONS, completion(add_special_tokens=False), "add_special_tokens"),
    (COMPLETIONS, completion(prompt_embeds="AAAA"), "prompt_embeds"),
    (CHAT, chat(min_tokens=5, max_tokens=2), "min_tokens"),
    (CHAT, chat(min_tokens=-1), "min_tokens"),
    (CHAT, chat(logit_bias={"x": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"1" * 5000: 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"7": 101}), "logit_bias"),
    # '²' is a digit to str.isdigit but not to int(): these were a 500
    (CHAT, chat(logit_bias={"²": 1}), "logit_bias"),
    (COMPLETIONS, completion(logit_bias={"²": 1}), "logit_bias"),
    # an unhashable value looked up in a set was a 500
    (
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "http://x/y.png", "detail": {}}}
                    ],
                }
            ]
        ),
        "messages[0].content[0].image_url.detail",
    ),
    (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(min_p=1.5), "min_p"),
    (CHAT, chat(ignore_eos="yes"), "ignore_eos"),
    (CHAT, chat(user=7), "user"),
    (CHAT, chat(user="u" * 257), "user"),
    (CHAT, chat(safety_identifier=7), "safety_identifier"),
    (COMPLETIONS, completion(safety_identifier="s" * 257), "safety_identifier"),
    # features the demo's workers do not list: refused before any worker is called
    (CHAT, chat(min_p=0.1), "min_p"),
    (CHAT, chat(repetition_penalty=1.2), "repetition_penalty"),
    (CHAT, chat(logit_bias={"7": 5}), "logit_bias"),
    (CHAT, chat(stop_token_ids=[2]), "stop_token_ids"),
    (COMPLETIONS, completion(min_p=0.1), "min_p"),
    (COMPLETIONS, completion(suffix="tail"), "suffix"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(temperature=2.01), "temperature"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(temperature=True), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_p=1.5), "top_p"),
    (CHAT, chat(presence_penalty=-2.5), "presence_penalty"),
    (COMPLETIONS, completion(frequency_penalty=2.5), "frequency_penalty"),
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-3), "max_tokens"),
    (CHAT, chat(max_tokens=1.5), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0, max_tokens=5), "max_completion_tokens"),
    # the deprecated max_tokens is checked too when max_completion_tokens wins
    (CHAT, chat(max_completion_tokens=5, max_tokens="abc"), "max_tokens"),
    (CHAT, chat(max_completion_tokens=5, max_tokens=0), "max_tokens"),
    (COMPLETIONS, completion(max_completion_tokens=5, max_tokens=[5]), "max_tokens"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (CHAT, chat(stop=[1]), "stop"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, {"model": "furnace-demo"}, "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=["hi"]), "messages[0]"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "look"},
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    ],
                }
            ]
        ),
        "messages[0].content",  # the demo takes no images
    ),
    (
        CHAT,
        chat(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "ftp://x"}]}]
        ),
        "messages[0].content[0].image_url",
    ),
    (
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
        "messages[0].content[0].input_audio.data",
    ),
    (
        CHAT,
        chat(messages=[*MESSAGES, {"role": "tool", "content": "42"}]),
        "messages[1].tool_call_id",
    ),
    (
        CHAT,
        chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]),
        "messages[0].tool_calls[0].function.name",
    ),
    # tool calls and their answers pair up, as OpenAI checks them
    (CHAT, chat(messages=[*MESSAGES, *called("c1"), answer("c2")]), "messages[2].tool_call_id"),
    (CHAT, chat(messages=[*MESSAGES, *called("c1"), *MESSAGES]), "messages[1].tool_calls"),
    (CHAT, chat(messages=[*MESSAGES, *called("c1")]), "messages[1].tool_calls"),
    (
        CHAT,
        chat(messages=[*MESSAGES, *called("c1"), answer("c1"), answer("c1")]),
        "messages[3].tool_call_id",
    ),
    (CHAT, chat(messages=[*MESSAGES, *called("")]), "messages[1].tool_calls[0].id"),
    (COMPLETIONS, completion(prompt=["a", "b"]), "prompt"),
    (COMPLETIONS, completion(prompt=[1, 2, 3]), "prompt"),
    (COMPLETIONS, completion(prompt=None), "prompt"),
    (COMPLETIONS, {"model": "furnace-demo"}, "prompt"),
    (CHAT, chat(model=7), "model"),
    (CHAT, chat(stream="yes"), "stream"),
    (
        CHAT,
        chat(stream=True, stream_options={"include_usage": "y"}),
        "stream_options.include_usage",
    ),
    # what stream_options asks is served or refused by name, never ignored
    (
        CHAT,
        chat(stream=True, stream_options={"continuous_usage_stats": "yes"}),
        "stream_options.continuous_usage_stats",
    ),
    (
        CHAT,
        chat(stream=True, stream_options={"include_obfuscation": "yes"}),
        "stream_options.include_obfuscation",
    ),
    (CHAT, chat(stream=True, stream_options={"usage": True}), "stream_options.usage"),
    (
        COMPLETIONS,
        completion(stream=False, stream_options={"include_usage": True, "x": None}),
        "stream_options.x",
    ),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(top_k=2**32), "top_k"),
    (CHAT, chat(max_tokens=2**32), "max_tokens"),
    (COMPLETIONS, completion(max_completion_tokens=10**30), "max_completion_tokens"),
    (CHAT, chat(seed=2**63), "seed"),
    (CHAT, chat(n=10**30), "n"),
    (CHAT, chat(seed="x"), "seed"),
]


@pytest.mark.parametrize(("route", "body", "param"), INVALID)
def test_invalid_parameter_is_a_400_naming_it(client, route, body, param):
    fixed = "stream" in body or "stream_options" in body
    for stream in (False, True):
        sent = body if fixed else {**body, "stream": stream}
        response = client.post(route, json=sent)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param
        assert error["code"] is None
        assert error["message"]


ACCEPTED = [
    (CHAT, chat(n=1, best_of=None, logprobs=False, tools=[], response_format={"type": "text"})),
    (CHAT, chat(temperature=0, top_p=1, presence_penalty=-2, frequency_penalty=2)),
    (CHAT, chat(temperature=2, top_k=0, seed=1234)),
    (CHAT, chat(top_k=-1)),
    (CHAT, chat(top_k=40)),
    (CHAT, chat(stop="x", max_completion_tokens=3, max_tokens=9)),
    (CHAT, chat(stop=["a", "b", "c", "d"])),
    (CHAT, chat(unknown_field={"deep": [1, 2]}, user="team-a", parallel_tool_calls=False)),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}])),
    (CHAT, chat(messages=[{"role": "assistant", "content": None}, *MESSAGES])),
    (COMPLETIONS, completion(echo=False, suffix="", best_of=1, logprobs=None)),
    (CHAT, chat(stream_options={"include_usage": True})),  # accepted, as OpenAI does
    (CHAT, chat(stream=False, stream_options={"include_usage": False})),
    (
        CHAT,
        chat(
            stream=True,
            stream_options={
                "include_usage": True,
                "continuous_usage_stats": False,
                "include_obfuscation": False,
            },
        ),
    ),
    (CHAT, chat(stream=True, stream_options={"include_obfuscation": True})),
    (COMPLETIONS, completion(stream=True, stream_options={"include_obfuscation": True})),
    (CHAT, chat(min_p=0, repetition_penalty=1, logit_bias={}, stop_token_ids=[], min_tokens=0)),
    (CHAT, chat(ignore_eos=False, skip_special_tokens=True, use_beam_search=False, echo=False)),
    (CHAT, chat(tool_choice="none", functions=None)),
    (CHAT, chat(store=False, service_tier="auto", verbosity="medium", priority=0)),
    (CHAT, chat(prompt_cache_retention="in_memory", prompt_cache_key="k")),
    (CHAT, chat(add_special_tokens=False, spaces_between_special_tokens=True)),
    (COMPLETIONS, completion(add_special_tokens=True, service_tier="default")),
    (COMPLETIONS, completion(n=2, best_of=2)),
    (COMPLETIONS, completion(prompt=["one string"])),
]


@pytest.mark.parametrize(("route", "body"), ACCEPTED)
def test_valid_parameters_are_served(client, route, body):
    response = client.post(route, json=body)
    assert response.status_code == 200, response.text


def test_max_completion_tokens_wins_over_max_tokens(client):
    body = chat(messages=[{"role": "user", "content": "a b c d e"}])
    response = client.post(CHAT, json={**body, "max_tokens": 4, "max_completion_tokens": 2})
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "a b"
    assert choice["finish_reason"] == "length"


def test_an_unknown_model_is_a_404_before_any_parameter_check(client):
    response = client.post(CHAT, json=chat(model="no-such-model", temperature=9, n=0))
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "furnace-demo" in error["message"]  # the models the caller may use


def test_one_model_is_listed_by_its_id(client):
    model = client.get("/v1/models/furnace-demo").json()
    assert model["id"] == "furnace-demo"
    assert model["object"] == "model"
    assert model["max_model_len"] > 0
    missing = client.get("/v1/models/org/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


class BiasedEngine(DemoEngine):
    """The demo, also taking `logit_bias`: keeps the biases each request asked for."""

    features = DemoEngine.features | {features.LOGIT_BIAS}

    def __init__(self) -> None:
        super().__init__("furnace-biased")
        self.biases: list[tuple[tuple[int, float], ...]] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.biases.append(request.sampling.logit_bias)
        sampling = replace(request.sampling, logit_bias=())
        async for event in super().generate(replace(request, sampling=sampling)):
            yield event


def test_logit_bias_keys_are_token_ids_in_ascii_digits(gateway_with, serve_engines):
    """OpenAI's keys are token ids as strings: an Arabic-Indic one (U+0661) is a digit
    to str.isdigit and 1 to int(), so it reached the worker as a bias on token 1."""
    engine = BiasedEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig("furnace-biased", workers=(worker.address,)),))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for route, body in ((CHAT, chat()), (COMPLETIONS, completion())):
            body = {**body, "model": "furnace-biased"}
            for key in ("\u0661", "\u00b2", "\u0663\u0664", "1\u0660", "+1", " 1", ""):
                response = http.post(route, json={**body, "logit_bias": {key: 1}})
                assert response.status_code == 400, (key, response.text)
                assert response.json()["error"]["param"] == "logit_bias"
            served = http.post(route, json={**body, "logit_bias": {"7": 5}})
            assert served.status_code == 200, served.text
    assert engine.biases == [((7, 5.0),)] * 2


class UserEngine(DemoEngine):
    """The demo, keeping the end user's id each request carried."""

    def __init__(self) -> None:
        super().__init__("furnace-users")
        self.users: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.users.append(request.user)
        async for event in super().generate(request):
            yield event


def test_safety_identifier_is_the_end_users_id_where_user_is_not_given(gateway_with, serve_engines):
    """OpenAI's newer name for `user`: the worker gets it as the request's user (refused
    as unserved before); `user` wins when both are given."""
    engine = UserEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig("furnace-users", workers=(worker.address,)),))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for route, body in ((CHAT, chat()), (COMPLETIONS, completion())):
            body = {**body, "model": "furnace-users"}
            for ids in ({"safety_identifier": "sid-1"}, {"user": "u-1", "safety_identifier": "s"}):
                served = http.post(route, json={**body, **ids})
                assert served.status_code == 200, served.text
    assert engine.users == ["sid-1", "u-1"] * 2
