"""Specs: whatever a client sends to Anthropic's routes, the answer is served or
refused in Anthropic's shape, never a 5xx, and nothing is left behind (the
`no_leaks` check): valid Messages and count_tokens bodies mutated in the seeded
random walk of test_fuzzed_bodies.py (the same bodies every run)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from tests.support.requests import no_5xx
from tests.support.servers import DEMO_MODEL
from tests.test_fuzzed_bodies import mutate

TOOL = {
    "name": "get_weather",
    "description": "d",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CONVERSATION = [
    {"role": "user", "content": "call get_weather"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "sunny",
                "is_error": False,
            },
            {"type": "text", "text": "and now", "cache_control": {"type": "ephemeral"}},
        ],
    },
]
#: Valid bodies the demo serves (200), each field a place to mutate.
BASES: dict[str, dict[str, Any]] = {
    "/v1/messages": {
        "model": DEMO_MODEL,
        "system": [{"type": "text", "text": "be brief"}],
        "messages": CONVERSATION,
        "max_tokens": 8,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 4,
        "stop_sequences": ["zz"],
        "metadata": {"user_id": "u"},
        "tools": [TOOL],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    },
    "/v1/messages/count_tokens": {
        "model": DEMO_MODEL,
        "system": "be brief",
        "messages": CONVERSATION,
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    },
}
BODIES_PER_ROUTE = 150


def bodies(path: str) -> list[Any]:
    rng = random.Random(path)
    found = []
    for _ in range(BODIES_PER_ROUTE):
        body = mutate(mutate(copy.deepcopy(BASES[path]), rng), rng)
        if path == "/v1/messages" and isinstance(body, dict):
            body["stream"] = rng.random() < 0.5
        found.append(body)
    return found


@pytest.mark.parametrize("path", list(BASES))
def test_the_bases_are_served(client, path):
    answer = client.post(path, json=BASES[path])
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("path", list(BASES))
def test_mutated_bodies_are_served_or_refused_in_anthropics_shape(client, path):
    for answer, body in no_5xx(client, path, bodies(path)):
        if answer.status_code >= 400:
            payload = answer.json()
            assert payload["type"] == "error", (payload, body)
            assert set(payload["error"]) == {"type", "message"}, (payload, body)
            assert payload["error"]["message"], (payload, body)
            if answer.status_code == 400:
                assert payload["error"]["type"] == "invalid_request_error", (payload, body)
        elif answer.headers["content-type"].startswith("text/event-stream"):
            assert answer.text.rstrip().endswith('{"type":"message_stop"}'), (answer.text, body)
        else:
            assert "error" not in answer.json(), (answer.text, body)
