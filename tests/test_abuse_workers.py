"""Holding the line against broken workers and hostile clients, end to end:
a worker that breaks the protocol, hostile stop strings, a disconnect storm of
200 streams, and a fuzz of bad bodies. After each, the shared leak check (the
`no_leaks` fixture) sees every slot, in-flight request and worker call free.

Kills, hangs and restarts of workers are in tests/test_fleet.py; slow and
silent clients, huge headers and bodies in tests/test_abuse_http.py; stalled
readers in tests/test_stalled_readers.py; a Redis stall in tests/test_limits_hold.py.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from gateway.config import ModelConfig
from gateway.worker.demo import DEMO_MODEL
from tests.support.process_usage import Usage
from tests.support.requests import assert_openai_error, sse_events, user
from tests.support.scripted_worker import SCRIPTED_MODEL, ScriptedWorker, script
from tests.support.waiting import HANG_GUARD, wait_until

MIB = 1024 * 1024


# -- a worker that breaks the protocol ------------------------------------------

BROKEN = {
    "unspecified finish reason": {"texts": 1, "reason": 0},
    "unknown finish reason": {"texts": 1, "reason": 99},
    "second Started": {"texts": 1, "restart": True},
    "event of no known kind": {"texts": 1, "unknown": True},
}


@pytest.mark.parametrize("plan", BROKEN.values(), ids=BROKEN.keys())
def test_a_protocol_break_is_an_engine_error_not_a_success(client, plan):
    response = client.post(
        "/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": script(**plan)}
    )
    assert response.status_code == 500
    assert assert_openai_error(response)["code"] == "engine_error"


@pytest.mark.parametrize("plan", BROKEN.values(), ids=BROKEN.keys())
def test_a_protocol_break_mid_stream_ends_with_an_error_and_done(client, plan):
    response = client.post(
        "/v1/chat/completions",
        json={"model": SCRIPTED_MODEL, "messages": user(script(**plan)), "stream": True},
    )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    finishes = [c["finish_reason"] for e in events[:-2] for c in e.get("choices", [])]
    assert not any(finishes), "a broken answer must not read as finished"


@pytest.fixture
def second_scripted(server_loop) -> Iterator[ScriptedWorker]:
    worker = ScriptedWorker()
    server_loop.call(worker.start())
    yield worker
    server_loop.call(worker.stop())


def test_a_message_over_the_receive_cap_is_not_retried(gateway_with, workers, second_scripted):
    both = (workers.scripted.address, second_scripted.address)
    gw = gateway_with(models=(ModelConfig(SCRIPTED_MODEL, workers=both),))
    seen = len(workers.scripted.calls) + len(second_scripted.calls)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        response = http.post(
            "/v1/completions",
            json={"model": SCRIPTED_MODEL, "prompt": script(huge=64 * MIB + 1)},
        )
    assert response.status_code == 500
    assert assert_openai_error(response)["code"] == "engine_error"
    assert len(workers.scripted.calls) + len(second_scripted.calls) == seen + 1
    wait_until(lambda: second_scripted.active == 0, "the second scripted worker to be idle")


# -- hostile stop strings ---------------------------------------------------------

WORD = "a" * 8000  # one token of the demo engine


def test_four_stop_strings_of_the_longest_length_complete(client):
    stops = ["a" * 1023 + end for end in "bcde"]  # near misses at every position
    prompt = " ".join([WORD] * 40)
    response = client.post(
        "/v1/completions", json={"model": DEMO_MODEL, "prompt": prompt, "stop": stops}
    )
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert set(choice["text"]) <= {"a", " "} and len(choice["text"]) >= len(WORD)
    response = client.post(
        "/v1/chat/completions",
        json={"model": DEMO_MODEL, "messages": user(prompt), "stop": stops, "stream": True},
    )
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])


def test_a_stop_string_one_character_too_long_is_a_400_naming_stop(client, workers):
    calls = workers.demo_engine.calls
    response = client.post(
        "/v1/completions", json={"model": DEMO_MODEL, "prompt": "hi", "stop": ["a" * 1025]}
    )
    assert response.status_code == 400
    assert assert_openai_error(response)["param"] == "stop"
    assert workers.demo_engine.calls == calls


# -- a disconnect storm -------------------------------------------------------------

STORM = 200


async def _storm(url: str) -> None:
    """Opens STORM streams on the slow model, waits for each to start, then
    closes them all at once."""
    prompt = " ".join(["word"] * 400)  # 20 s of tokens at the slow model's pace
    limits = httpx.Limits(max_connections=STORM, max_keepalive_connections=0)
    http = httpx.AsyncClient(base_url=url, timeout=HANG_GUARD, limits=limits)
    async with http, AsyncExitStack() as streams:

        async def open_one() -> None:
            response = await streams.enter_async_context(
                http.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={"model": "furnace-slow", "messages": user(prompt), "stream": True},
                )
            )
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")

        await asyncio.gather(*(open_one() for _ in range(STORM)))
    # leaving the stack closed every stream's connection


def test_a_disconnect_storm_leaves_nothing_behind(gateway, client, workers):
    engine = workers.slow_engine
    warm = client.post(
        "/v1/chat/completions",
        json={"model": "furnace-slow", "messages": user("warm up"), "stream": True},
    )
    assert sse_events(warm.text)[-1] == "[DONE]"
    wait_until(lambda: engine.running == 0, "the slow engine to be idle")
    before = Usage.now()
    calls, ended = engine.calls, engine.finished + engine.aborted + engine.refused
    aborted = engine.aborted
    asyncio.run(asyncio.wait_for(_storm(gateway.url), HANG_GUARD * 2))
    wait_until(lambda: gateway.state.slots.in_use == 0, "all slots to be free")
    wait_until(lambda: not gateway.state.inflight.running, "no request in flight")
    wait_until(lambda: engine.running == 0, "the slow engine to be idle")
    assert engine.calls - calls == STORM
    assert engine.finished + engine.aborted + engine.refused - ended == STORM
    assert engine.aborted > aborted, "the closed streams' generations were not cancelled"
    before.assert_back_near(fd_slack=16, rss_slack=256 * MIB)


# -- a fuzz of bad bodies -------------------------------------------------------------

SEED = 20261130
NOT_NUMBERS = ["NaN", "Infinity", "-Infinity", "1", "", "\u202e1", [], [1], {}, {"a": 1}, True]
HUGE = [10**40, -(10**40), 1e308, -1e308, 2**64, -(2**64)]
NOT_INTS = [*NOT_NUMBERS, 1.5, 0.5]
NOT_FLAGS = ["true", 1, 0, [], {}, [True], "\x00", {"": None}]
NOT_STRINGS = [1, 1.5, True, [], ["x"], {}, {"x": "y"}]

#: For each field the gateway checks: values that must be refused (for both
#: routes unless named in ONLY).
BAD: dict[str, list[Any]] = {
    "model": NOT_STRINGS,
    "temperature": [*NOT_NUMBERS, *HUGE, -0.1, 2.0001],
    "top_p": [*NOT_NUMBERS, *HUGE, 0, -1, 1.01],
    "presence_penalty": [*NOT_NUMBERS, *HUGE, -2.5, 2.5],
    "frequency_penalty": [*NOT_NUMBERS, *HUGE, -2.5, 2.5],
    "top_k": [*NOT_INTS, 2**40, -2, -(10**40)],
    "seed": [*NOT_INTS, 2**63, -(2**63) - 1, 10**40],
    "max_tokens": [*NOT_INTS, 0, -1, 2**32, 10**40],
    "max_completion_tokens": [*NOT_INTS, 0, -1, 2**32],
    "n": [*NOT_INTS, 0, -1, 129, 10**40],
    "stream": NOT_FLAGS,
    "stream_options": ["x", 1, [], [{}], True],
    "response_format": [
        "json",
        1,
        [],
        {"type": "xml"},
        {"type": ["text"]},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "a b"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
    ],
    "stop": [
        1,
        {},
        [1],
        [[]],
        [{"a": "b"}],
        ["a"] * 5,
        "x" * 1025,
        ["\U0001f600" * 1025],
        [None],
        True,
    ],
    "messages": [
        "hi",
        {},
        [],
        [1],
        [[]],
        [None],
        [{"role": "robot", "content": "x"}],
        [{"role": 5, "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": ["x"]}],
        [{"role": "user\u0000", "content": "x"}],
    ],
    "logprobs": ["yes", [1], {"a": 1}, 21, -1],
    "top_logprobs": [1, 5, 21, -1, "yes", [1]],
    "tools": [[{"type": "function"}], {"a": 1}, "x", 1, [{"type": "function", "function": {}}]],
    "tool_choice": ["any", 1, {"type": "function"}, "required", {"function": {"name": "f"}}],
    "parallel_tool_calls": NOT_FLAGS,
    "min_tokens": [*NOT_INTS, -1, 2**32],
    "ignore_eos": NOT_FLAGS,
    "repetition_penalty": [*NOT_NUMBERS, 0, -1, 2.5],
    "min_p": [*NOT_NUMBERS, -0.1, 1.5],
    "logit_bias": ["x", [1], {"x": 1}, {"1": 101}, {"1": "1"}, {"9" * 400: 1}],
    "stop_token_ids": ["x", [-1], [1.5], [2**32], [True]],
    "user": [*NOT_STRINGS, "u" * 257],
    "functions": [[{"name": "f"}], "x"],
    "guided_json": [{"type": "object"}],
    "structured_outputs": ["x", 1, [], {"choice": [1]}, {"regex": {}}, {"json": "["}],
    "prompt": [5, [], ["a", "b"], {}, [["a"]], [5], None, True, 1.5],
    "best_of": [2, "1", [], 1.5],
    "echo": ["yes", 1, []],
    "suffix": ["x", 1, [1], {"a": 1}],
}
ONLY = {
    "messages": "/v1/chat/completions",
    "top_logprobs": "/v1/chat/completions",
    "tools": "/v1/chat/completions",
    "parallel_tool_calls": "/v1/chat/completions",
    "prompt": "/v1/completions",
    "best_of": "/v1/completions",
    "echo": "/v1/completions",
    "suffix": "/v1/completions",
}
UNICODE = ["\U0001f525", "e\u0301", "\u202etxet", "\ufeff", "\u0000", "\uffff", "\U0010ffff"]
#: Bodies that are not JSON objects at all, or not JSON (NaN literals, lone surrogates).
RAW = [
    b"[]",
    b'"hi"',
    b"5",
    b"null",
    b'{"model": "furnace-demo", "temperature": NaN, "prompt": "x"}',
    b'{"model": "furnace-demo", "temperature": Infinity, "prompt": "x"}',
    b'{"model": "furnace-demo", "prompt": "\\ud800",'
    b' "messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"model": "furnace-demo", "prompt": "x", "prompt": ',
    b"\xff\xfe{}",
    b'{"model": "furnace-demo", "messages": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
]


def _valid(route: str, rng: random.Random) -> dict[str, Any]:
    text = "hello " + rng.choice(UNICODE)
    if route == "/v1/chat/completions":
        return {"model": DEMO_MODEL, "messages": user(text)}
    return {"model": DEMO_MODEL, "prompt": text}


def _cases() -> list[tuple[str, str | None, Any]]:
    """(route, the field at fault or None, the body): every bad value of every
    field, plus seeded mixes of several bad fields and wrapped values."""
    rng = random.Random(SEED)
    cases: list[tuple[str, str | None, Any]] = []
    for route in ("/v1/chat/completions", "/v1/completions"):
        for field, values in BAD.items():
            if ONLY.get(field, route) != route:
                continue
            for value in values:
                body = _valid(route, rng)
                body[field] = value
                if field == "stream_options" and isinstance(value, dict):
                    body["stream"] = False
                cases.append((route, field, body))
        for _ in range(60):  # several bad fields at once: some param is named
            body = _valid(route, rng)
            for field in rng.sample([f for f in BAD if ONLY.get(f, route) == route], 3):
                value = rng.choice(BAD[field])
                body[field] = [value] if rng.random() < 0.2 and field != "stop" else value
            cases.append((route, "", body))
        for raw in RAW:
            cases.append((route, None, raw))
    return cases


def test_an_integer_past_64_bits_is_out_of_range_not_of_the_wrong_type(client):
    """JSON reads such an integer as a float: the refusal says its range, as for any
    integer out of range; a fraction is still the wrong type."""
    for field, value, says in (
        ("seed", 10**20, "must be in"),
        ("seed", -(10**20), "must be in"),
        ("max_tokens", 10**30, "must be in"),
        ("max_tokens", 1.5, "expected an integer"),
    ):
        body = {"model": DEMO_MODEL, "messages": user("a"), field: value}
        response = client.post("/v1/chat/completions", json=body)
        error = assert_openai_error(response)
        assert response.status_code == 400 and error["param"] == field
        assert says in error["message"], error


def test_a_fuzz_of_bad_bodies_gets_4xx_in_openai_shape_and_reaches_no_worker(client, workers):
    cases = _cases()
    assert len(cases) >= 300
    calls = (workers.demo_engine.calls, len(workers.scripted.calls), workers.slow_engine.calls)
    for route, field, body in cases:
        if isinstance(body, bytes):
            response = client.post(
                route, content=body, headers={"content-type": "application/json"}
            )
        else:
            response = client.post(route, json=body)
        shown = body[:80] if isinstance(body, bytes) else json.dumps(body, default=repr)[:200]
        where = f"{route} {shown!r}"
        assert 400 <= response.status_code < 500, f"{response.status_code} for {where}"
        error = assert_openai_error(response)
        if field:
            assert error["param"] is not None and error["param"].startswith(field), (
                f"{error} for {where}"
            )
        elif field == "":
            assert error["param"], f"{error} for {where}"
    now = (workers.demo_engine.calls, len(workers.scripted.calls), workers.slow_engine.calls)
    assert now == calls, "a bad body reached a worker"


# -- a request with no bound under a team's tokens per minute ---------------------


def test_a_request_with_no_max_tokens_gets_its_teams_reservation_as_its_bound(
    gateway_with, workers
):
    """A model with no cap, a team of 80 tokens a minute (less than the scripted model's
    context of 100), a request that sets no max_tokens: the worker is told to write at
    most what the team reserved for it, not the context (one such answer had used
    50,000 tokens). A grant past the context is not sent: the context bounds it."""
    from tests.support.keys import bearer, keyed, new_key

    key = new_key("a")
    teams = {"a": {"tokens_per_minute": 80}}
    gw = gateway_with(**keyed(teams, {key: "a"}))
    prompt = script(texts=2)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as http:
        for body in ({}, {"max_tokens": 5}):
            sent = len(workers.scripted.calls)
            answer = http.post(
                "/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": prompt, **body}
            )
            assert answer.status_code == 200, answer.text
            (rid,) = workers.scripted.calls[sent:]
            bound = workers.scripted.max_tokens[rid]
            if "max_tokens" in body:
                assert bound == 5
            else:
                estimate = -(-len(prompt) // 4)
                assert bound is not None and 1 <= bound <= 80 - estimate


# -- schemas a worker would compile: OpenAI's limits at the edge ---------------------


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _wide(properties: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(properties)},
    }


SCHEMAS_OVER = {
    "5,001 properties": (_wide(5001), "5000 object properties"),
    "11 levels": (_nested(11), "10 levels of nesting"),
    "1,001 enum values": ({"enum": list(range(1001))}, "1000 enum values"),
    "120,001 name characters": (
        {"type": "object", "properties": {"n" * 60_001: {}, "m" * 60_000: {}}},
        "120000 characters",
    ),
    "a long enum of 251 strings": ({"enum": ["e" * 60 + str(i) for i in range(251)]}, "15000"),
    "anyOf 10,001 deep": ({"anyOf": [{"type": "null"}] * 10_001}, "10000 subschemas"),
}


@pytest.mark.parametrize(("schema", "says"), SCHEMAS_OVER.values(), ids=SCHEMAS_OVER.keys())
def test_a_schema_past_openais_limits_is_a_400_naming_where_it_is(client, schema, says):
    format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    response = client.post(
        "/v1/chat/completions",
        json={"model": DEMO_MODEL, "messages": user("hi"), "response_format": format_},
    )
    assert response.status_code == 400, response.text
    error = assert_openai_error(response)
    assert error["param"] == "response_format.json_schema.schema"
    assert says in error["message"]


def test_the_limits_count_every_schema_of_a_request_together(client):
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": _wide(1000)}}
        for i in range(6)
    ]
    response = client.post(
        "/v1/chat/completions", json={"model": DEMO_MODEL, "messages": user("hi"), "tools": tools}
    )
    assert response.status_code == 400, response.text
    assert assert_openai_error(response)["param"] == "tools[5].function.parameters"
    fits = {"type": "json_schema", "json_schema": {"name": "s", "schema": _nested(10)}}
    body = {"model": DEMO_MODEL, "messages": user("hi"), "tools": tools[:4], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json={**body, "response_format": fits})
    if response.status_code == 400:  # the demo may refuse the pair, but not for the limits
        assert "the request's schemas hold" not in response.text, response.text


NOT_SCHEMAS = {
    "required a number": ({"type": "object", "required": 5}, "(at required)"),
    "properties a list": ({"type": "object", "properties": []}, "(at properties)"),
    "minimum a string": ({"type": "integer", "minimum": "x"}, "(at minimum)"),
    "minItems a string": ({"type": "array", "minItems": "x"}, "(at minItems)"),
    "a misspelt type": (
        {"type": "object", "properties": {"a": {"type": "strin"}}},
        "(at properties/a/type)",
    ),
    "an item not a schema": ({"type": "array", "items": [{}, 5]}, "(at items/1)"),
    "an empty anyOf": ({"anyOf": []}, "(at anyOf)"),
}


@pytest.mark.parametrize(("schema", "says"), NOT_SCHEMAS.values(), ids=NOT_SCHEMAS.keys())
def test_what_is_not_a_schema_is_a_400_saying_where_and_no_worker_is_ejected(
    client, workers, schema, says
):
    """Handed to a worker, `"required": 5` failed in it (a 500), and three such requests
    ejected a model's only worker for every client."""
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    calls = workers.demo_engine.calls
    for extra, param in (
        ({"response_format": format_}, "response_format.json_schema.schema"),
        ({"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters"),
    ):
        for _ in range(4):
            body = {"model": DEMO_MODEL, "messages": user("hi"), **extra}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, response.text
            error = assert_openai_error(response)
            assert error["param"] == param
            assert f"Invalid schema for '{param}' {says}" in error["message"]
    assert workers.demo_engine.calls == calls  # refused at the edge
    answer = client.post("/v1/chat/completions", json={"model": DEMO_MODEL, "messages": user("hi")})
    assert answer.status_code == 200, answer.text


def test_what_is_not_a_schema_is_refused_on_the_responses_and_anthropic_routes(client, workers):
    """The other APIs' schemas go through the same checks (and OpenAI's limits)."""
    schema = {"type": "object", "required": 5}
    calls = workers.demo_engine.calls
    responses = {"model": DEMO_MODEL, "input": "hi"}
    for extra, param in (
        (
            {"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}},
            "text.format.schema",
        ),
        (
            {
                "tools": [{"type": "function", "name": "f", "parameters": schema}],
                "tool_choice": "required",
            },
            "tools[0].parameters",
        ),
    ):
        for _ in range(4):
            response = client.post("/v1/responses", json={**responses, **extra})
            assert response.status_code == 400, response.text
            assert assert_openai_error(response)["param"] == param
    tool = {"name": "f", "input_schema": schema}
    messages = {"model": DEMO_MODEL, "max_tokens": 8, "messages": user("hi")}
    for _ in range(4):
        body = {**messages, "tools": [tool], "tool_choice": {"type": "any"}}
        response = client.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "Invalid schema for 'tools[0].input_schema' (at required)" in error["message"]
    assert workers.demo_engine.calls == calls  # refused at the edge
    answer = client.post("/v1/chat/completions", json={"model": DEMO_MODEL, "messages": user("hi")})
    assert answer.status_code == 200, answer.text


def test_a_schema_whose_smallest_value_is_huge_is_refused_by_the_demo(client):
    """A valid schema may ask for a terabyte (`minLength`): the demo engine, which
    writes a schema's smallest value, says it cannot, as a 400."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 10**12}}}
    schema["required"] = ["a"]
    format_ = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"model": DEMO_MODEL, "messages": user("hi"), "response_format": format_}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = assert_openai_error(response)
    assert error["param"] == "response_format"
    assert "more than 65536 characters" in error["message"]


# -- what one request may make: n x max_tokens x logprobs ----------------------------


def test_n_times_max_tokens_times_logprobs_past_the_bound_is_a_400(client, workers):
    # the issue's request: 128 choices of 1,000 tokens with 20 alternatives each
    calls = workers.demo_engine.calls
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "n": 128,
        "max_tokens": 1000,
        "logprobs": True,
        "top_logprobs": 20,
    }
    for stream in (False, True):
        answer = client.post("/v1/chat/completions", json={**body, "stream": stream})
        assert answer.status_code == 400
        error = assert_openai_error(answer)
        assert error["param"] == "max_tokens"
        assert "'n'" in error["message"] and "'top_logprobs'" in error["message"]
    legacy = {"prompt": "hi", "n": 128, "max_tokens": 1000, "logprobs": 5}
    answer = client.post("/v1/completions", json=legacy)
    assert answer.status_code == 400
    assert assert_openai_error(answer)["param"] == "max_tokens"
    assert workers.demo_engine.calls == calls  # refused before any worker
    # within the bound: served
    body.update(n=2, max_tokens=8)
    assert client.post("/v1/chat/completions", json=body).is_success


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": user("x")}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": user("x")}, "max_tokens"),
        ("/v1/completions", {"prompt": "x"}, "max_tokens"),
        ("/v1/responses", {"input": "x"}, "max_output_tokens"),
        ("/v1/messages", {"messages": user("x")}, "max_tokens"),
    ],
)
def test_the_bound_names_the_length_as_the_client_did_in_its_apis_words(client, route, body, param):
    """A length past the bound alone was refused naming `max_tokens` and talking of
    'n' and logprobs, whatever the client sent and whether its API has them."""
    answer = client.post(route, json={"model": DEMO_MODEL, **body, param: 10_000_000})
    assert answer.status_code == 400, answer.text
    if route == "/v1/messages":
        error = answer.json()["error"]  # Anthropic's shape: no param, the message names it
        assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        error = assert_openai_error(answer)
        assert error["param"] == param
    message = error["message"]
    assert f"'{param}'" in message and "10000000" in message, message
    others = {"max_tokens", "max_completion_tokens", "max_output_tokens"} - {param}
    assert not any(f"'{other}'" in message for other in others), message
    assert "'n'" not in message and "logprobs" not in message, message


def test_the_bound_names_n_and_logprobs_where_the_request_asked_for_them(client):
    """Each factor the client may lower, by its API's name for it."""
    body = {"messages": user("x"), "n": 64, "max_completion_tokens": 10_000}
    error = assert_openai_error(client.post("/v1/chat/completions", json=body))
    assert error["param"] == "max_completion_tokens"
    assert "'n' (64) x 'max_completion_tokens' (10000)" in error["message"]
    assert "logprobs" not in error["message"]
    legacy = {"prompt": "x", "max_tokens": 50_000, "logprobs": 5}
    error = assert_openai_error(client.post("/v1/completions", json=legacy))
    assert error["param"] == "max_tokens"
    assert "'max_tokens' (50000) x (2 + 'logprobs' (5))" in error["message"]
    assert "'n'" not in error["message"] and "top_logprobs" not in error["message"]


def test_a_models_cap_names_the_length_as_the_client_did(gateway_with, workers):
    """The model's `max_tokens_limit` refused `max_completion_tokens` as `max_tokens`."""
    capped = ModelConfig(DEMO_MODEL, workers=(workers.demo.address,), max_tokens_limit=4)
    gw = gateway_with(models=(capped,))
    body = {"messages": user("x"), "max_completion_tokens": 5}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        error = assert_openai_error(http.post("/v1/chat/completions", json=body))
    assert error["param"] == "max_completion_tokens"
    assert "'max_completion_tokens'" in error["message"]
    assert "'max_tokens'" not in error["message"]


def test_without_max_tokens_a_request_gets_the_most_that_fits(gateway_with):
    # 4 choices with 5 alternatives: 4 x (2 + 5) = 28 units a token; 280 fit 10 tokens,
    # and the demo model's context (64) could pass that
    gw = gateway_with(max_output_units=280)
    body = {"prompt": " ".join(f"w{i}" for i in range(30)), "n": 4, "logprobs": 5}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200
    choices = answer.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["length"] * 4
    assert answer.json()["usage"]["completion_tokens"] == 40
