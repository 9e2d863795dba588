"""A batch's input file read into its requests, or the errors that fail the batch.

Each line of the JSONL file is one request, OpenAI's shape:
`{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`.
The batch fails (`status: failed`, its `errors` naming each line at fault, the first
`MAX_ERRORS`) when a line is not such an object, names another endpoint than the
batch's, repeats a custom_id, asks for a stream (a batch's answers are written whole),
names another model than the first line's (OpenAI's rule: one model a file), or is
larger than a request body may be; or when the file has no line or more than the
gateway's `batch_max_requests`. What a body holds past that is the endpoint's own
business: checked when its line runs, as any request is, and a 400 there is that
line's answer in the error file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

#: Errors listed when a file fails validation; past them, the file's first lines name
#: what to fix.
MAX_ERRORS = 100
#: The longest custom_id (OpenAI's limit is not published; this bounds what is stored).
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch: its place in the file (0-based), id and body."""

    index: int
    custom_id: str
    body: dict[str, Any]


def _error(code: str, message: str, line: int | None, param: str | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def read_lines(
    content: bytes, endpoint: str, max_requests: int, max_body: int, bodies: bool = True
) -> tuple[list[Line], list[dict[str, Any]]]:
    """The file's requests, and the errors that fail its batch (none: it may run).
    Lines are numbered from 1 in the errors, as OpenAI's are; blank lines are skipped.
    `bodies`: OpenAI's checks of the bodies too (size, model, one model a file, no
    stream); Anthropic's Message Batches mix models, and a body at fault there is its
    own request's `errored` result, not the batch's."""
    lines: list[Line] = []
    found: list[dict[str, Any]] = []
    seen: set[str] = set()
    model: str | None = None
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if len(found) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        if len(lines) >= max_requests:
            found.append(
                _error(
                    "too_many_requests",
                    f"The file has more than {max_requests} requests, the most a batch "
                    "may hold here.",
                    number,
                    None,
                )
            )
            break
        problem = _check(raw, number, endpoint, seen)
        if isinstance(problem, Line) and bodies:
            problem = _check_body(raw, problem, number, max_body, model)
        if isinstance(problem, dict):
            found.append(problem)
            continue
        model = model or problem.body.get("model")
        seen.add(problem.custom_id)
        lines.append(Line(len(lines), problem.custom_id, problem.body))
    if not lines and not found:
        found.append(_error("empty_file", "The input file has no requests.", None, None))
    return lines, found


def _check(raw: bytes, number: int, endpoint: str, seen: set[str]) -> Line | dict[str, Any]:
    """One line as a request, or its error."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _error("invalid_json_line", f"Line {number} is not valid JSON.", number, None)
    if not isinstance(value, dict):
        return _error("invalid_json_line", f"Line {number} is not a JSON object.", number, None)
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID:
        message = f"Line {number}: 'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters."
        return _error("invalid_request", message, number, "custom_id")
    if custom_id in seen:
        message = f"Line {number}: the custom_id '{custom_id}' is used by an earlier line."
        return _error("duplicate_custom_id", message, number, "custom_id")
    if value.get("method") != "POST":
        message = f"Line {number}: 'method' must be 'POST'."
        return _error("invalid_request", message, number, "method")
    if value.get("url") != endpoint:
        message = f"Line {number}: 'url' must be the batch's endpoint, '{endpoint}'."
        return _error("invalid_url", message, number, "url")
    body = value.get("body")
    if not isinstance(body, dict):
        return _error(
            "invalid_request", f"Line {number}: 'body' must be an object.", number, "body"
        )
    return Line(0, custom_id, body)


def _check_body(
    raw: bytes, line: Line, number: int, max_body: int, model: str | None
) -> Line | dict[str, Any]:
    """OpenAI's checks of a line's body: the line itself, or its error."""
    body = line.body
    if len(raw) > max_body:
        message = f"Line {number} is larger than {max_body} bytes, the largest request body."
        return _error("request_too_large", message, number, "body")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        message = f"Line {number}: 'body.model' must name a model."
        return _error("missing_required_parameter", message, number, "body.model")
    if model is not None and name != model:
        message = (
            f"Line {number} names the model '{name[:128]}', and the file's first request "
            f"'{model}': a batch's requests all use one model."
        )
        return _error("mismatched_model", message, number, "body.model")
    if body.get("stream") not in (None, False) or body.get("background") not in (None, False):
        param = "body.stream" if body.get("stream") not in (None, False) else "body.background"
        message = f"Line {number}: a batch's requests are answered whole; '{param}' is not served."
        return _error("invalid_request", message, number, param)
    return line
