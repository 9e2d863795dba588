"""Specs: whatever a client sends in a body, the answer is served or refused in
OpenAI's shape, never a 5xx, and nothing is left behind (the `no_leaks` check).

test_validation.py states each rule, and test_abuse_workers.py refuses bad values field
by field; this spec looks for the rules nobody wrote:
valid bodies with fields dropped, swapped for values of other types, extreme
numbers, or repeated, in a seeded random walk (the same bodies every run)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from tests.support.requests import assert_openai_error, no_5xx
from tests.support.servers import DEMO_MODEL

#: Valid bodies the demo serves (200), each field a place to mutate.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": DEMO_MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
        ],
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stop": ["x"],
        "logprobs": True,
        "top_logprobs": 2,
        "seed": 3,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "user": "u",
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "d",
                    "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
                },
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "object"}},
        },
        "stream_options": {"include_usage": True},
    },
    "/v1/completions": {
        "model": DEMO_MODEL,
        "prompt": "hello world",
        "max_tokens": 8,
        "temperature": 0.2,
        "n": 1,
        "logprobs": 2,
        "stop": "zz",
        "best_of": 1,
        "stream_options": {"include_usage": True},
    },
    "/v1/embeddings": {"model": DEMO_MODEL, "input": ["a b", "c"], "encoding_format": "float"},
}
#: What a field may become.
ODD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    -(2**63),
    10**30,
    1e308,
    -0.0,
    1.5,
    "",
    "x",
    "1",
    "é" * 5,
    [],
    [1],
    ["a"],
    [None],
    [[1, 2]],
    {},
    {"a": 1},
    {"type": "text"},
]
BODIES_PER_ROUTE = 150


def mutate(value: Any, rng: random.Random) -> Any:
    """`value` with one change somewhere inside it: a field dropped, replaced or
    mutated in turn, an item replaced, a list repeated, or a leaf replaced."""
    if isinstance(value, dict):
        changed = dict(value)
        if changed and rng.random() < 0.7:
            key = rng.choice(list(changed))
            draw = rng.random()
            if draw < 0.15:
                del changed[key]
            elif draw < 0.55:
                changed[key] = rng.choice(ODD)
            else:
                changed[key] = mutate(changed[key], rng)
        if rng.random() < 0.1:
            changed[rng.choice(["extra", "messages", "prompt", "input", "n"])] = rng.choice(ODD)
        return changed
    if isinstance(value, list):
        if value and rng.random() < 0.6:
            changed = list(value)
            index = rng.randrange(len(changed))
            changed[index] = mutate(changed[index], rng) if rng.random() < 0.6 else rng.choice(ODD)
            return changed
        return value * rng.randint(2, 5) if rng.random() < 0.3 else value
    return rng.choice(ODD) if rng.random() < 0.5 else value


def bodies(path: str) -> list[dict[str, Any]]:
    rng = random.Random(path)
    found = []
    for _ in range(BODIES_PER_ROUTE):
        body = mutate(mutate(copy.deepcopy(BASES[path]), rng), rng)
        if path != "/v1/embeddings" and isinstance(body, dict):
            body["stream"] = rng.random() < 0.5
        found.append(body)
    return found


@pytest.mark.parametrize("path", list(BASES))
def test_the_bases_are_served(client, path):
    body = {**BASES[path], "stream": False} if path != "/v1/embeddings" else BASES[path]
    assert client.post(path, json=body).status_code == 200


@pytest.mark.parametrize("path", list(BASES))
def test_mutated_bodies_are_served_or_refused_in_openai_shape(client, path):
    for answer, body in no_5xx(client, path, bodies(path)):
        if answer.status_code >= 400:
            error = assert_openai_error(answer)
            if answer.status_code == 400:
                assert error["param"], (error, body)  # a refusal names what it refuses
        elif answer.headers["content-type"].startswith("text/event-stream"):
            assert answer.text.rstrip().endswith("data: [DONE]"), (answer.text, body)
        else:
            assert "error" not in answer.json(), (answer.text, body)
