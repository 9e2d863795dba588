"""Building OpenAI-shaped requests and reading their answers (SSE streams, errors)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx


def user(text: str) -> list:
    """A chat of one user message."""
    return [{"role": "user", "content": text}]


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    """The body is an error in OpenAI's shape; returns its `error` object."""
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert "param" in error and "code" in error
    return error  # type: ignore[no-any-return]


def no_5xx(
    client: httpx.Client, path: str, bodies: Iterable[Any]
) -> Iterator[tuple[httpx.Response, Any]]:
    """Each body posted to `path` as JSON, with its answer, which is never a 5xx (the
    fuzz specs' loop); at the end, both answers (200) and refusals (400) have come."""
    statuses: dict[int, int] = {}
    for body in bodies:
        answer = client.post(
            path, content=json.dumps(body), headers={"content-type": "application/json"}
        )
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        assert answer.status_code < 500, (answer.text, body)
        yield answer, body
    assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses  # both kinds ran


def sse_events(text: str) -> list:
    """The data payloads of an SSE body, [DONE] as a string."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def opened(response: httpx.Response) -> Iterator[str]:
    """The stream's lines, after checking the first arrived. Keep the iterator
    until done: dropping it closes the connection (the client going away)."""
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return lines


#: The cache part of an answer's chat/completions usage where the engine found none of
#: the prompt in its prefix cache: there always, as OpenAI's is.
NO_CACHE = {"prompt_tokens_details": {"cached_tokens": 0}}


def whole_input(usage: Any) -> int:
    """An Anthropic usage's whole input (an SDK object or the wire's dict): its
    `input_tokens` are only the prompt's tokens its prefix cache did not hold."""
    fields = usage if isinstance(usage, dict) else vars(usage)
    cached = (
        fields.get(name) or 0 for name in ("cache_read_input_tokens", "cache_creation_input_tokens")
    )
    return int(fields["input_tokens"]) + sum(cached)
