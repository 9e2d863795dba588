"""Specs: whatever a client sends to `POST /v1/responses`, the answer is served or
refused in OpenAI's shape naming the parameter, never a 5xx, and nothing is left
behind (the `no_leaks` check): valid bodies mutated in a seeded random walk, as
tests/test_fuzzed_bodies.py does for chat (its `mutate`)."""

from __future__ import annotations

import copy
import random
from typing import Any

from tests.support.requests import assert_openai_error, no_5xx
from tests.support.servers import DEMO_MODEL
from tests.test_fuzzed_bodies import mutate

#: A valid body the demo serves (200) using every served field, each a place to mutate.
BASE: dict[str, Any] = {
    "model": DEMO_MODEL,
    "instructions": "be brief",
    "input": [
        {"role": "developer", "content": "answer plainly"},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "hello there"},
                {"type": "input_text", "text": " f"},
            ],
        },
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"role": "user", "content": "again"},
    ],
    "tools": [
        {
            "type": "function",
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            "strict": False,
        }
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    "max_output_tokens": 8,
    "temperature": 0.5,
    "top_p": 0.9,
    "metadata": {"k": "v"},
    "user": "u",
    "truncation": "disabled",
    "store": False,
    "include": [],
}
BODIES = 200


def bodies() -> list[Any]:
    rng = random.Random("/v1/responses")
    found = []
    for _ in range(BODIES):
        body = mutate(mutate(copy.deepcopy(BASE), rng), rng)
        if isinstance(body, dict):
            body["stream"] = rng.random() < 0.5
            if rng.random() < 0.3:  # some stored, to fill the store too
                body["store"] = True
        found.append(body)
    return found


def test_the_base_is_served(client):
    assert client.post("/v1/responses", json=BASE).status_code == 200


def test_mutated_bodies_are_served_or_refused_in_openai_shape(client):
    for answer, body in no_5xx(client, "/v1/responses", bodies()):
        if answer.status_code >= 400:
            error = assert_openai_error(answer)
            if answer.status_code == 400:
                assert error["param"], (error, body)  # a refusal names what it refuses
        elif answer.headers["content-type"].startswith("text/event-stream"):
            last = answer.text.rstrip().rsplit("\n", 1)[-1]
            assert last.startswith("data: ") and (
                '"type":"response.completed"' in last or '"type":"response.incomplete"' in last
            ), (answer.text, body)
        else:
            assert answer.json()["status"] in ("completed", "incomplete"), (answer.text, body)
