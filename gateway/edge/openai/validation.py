"""Turns an OpenAI request body into our `GenerateRequest`, or a 400 naming the
parameter at fault, with the rules OpenAI-compatible servers apply.

Unknown fields are ignored so that SDKs sending extras keep working; features
we do not serve (n > 1, logprobs, tools, JSON mode, echo, suffix) are refused
rather than silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.edge.errors import invalid
from gateway.protocol.types import GenerateRequest, Message, SamplingParams

MAX_STOP = 4
#: The longest stop string, in characters: a worker holds back that much text.
MAX_STOP_CHARS = 1024
UINT32_MAX = 2**32 - 1  # the worker protocol's counts are uint32
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A valid request: what to generate, and how to answer."""

    model: str | None
    generate: GenerateRequest
    stream: bool
    include_usage: bool


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise invalid(name, f"Invalid type for '{name}': expected a number.")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(name, f"Invalid value for '{name}': must be in {bracket}{low:g}, {high:g}].")
    return float(value)


def _int(
    body: Mapping[str, Any], name: str, low: int = -(2**63), high: int = 2**63 - 1
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise invalid(name, f"Invalid type for '{name}': expected an integer.")
    if not low <= value <= high:
        raise invalid(name, f"Invalid value for '{name}': must be in [{low}, {high}].")
    return value


def _flag(body: Mapping[str, Any], name: str, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(where + name, f"Invalid type for '{where}{name}': expected a boolean.")
    return value


def _only_one(body: Mapping[str, Any], name: str) -> None:
    value = _int(body, name)
    if value is not None and value != 1:
        raise invalid(name, f"Only {name}=1 is supported.")


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    return _int(body, name, 1, UINT32_MAX)


def _top_k(body: Mapping[str, Any]) -> int | None:
    value = _int(body, "top_k", high=UINT32_MAX)
    if value is None or value in (0, -1):
        return None
    if value < -1:
        raise invalid("top_k", "Invalid value for 'top_k': must be -1, 0 (off) or positive.")
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop", "Invalid type for 'stop': expected a string or a list of strings.")
    if len(value) > MAX_STOP:
        raise invalid("stop", f"Invalid value for 'stop': at most {MAX_STOP} stop strings.")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise invalid(
            "stop", f"Invalid value for 'stop': at most {MAX_STOP_CHARS} characters each."
        )
    return tuple(s for s in value if s)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, low_open=True),
        top_k=_top_k(body),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2),
        seed=_int(body, "seed"),
        max_tokens=_max_tokens(body),
    )


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise invalid("stream_options", "Invalid type for 'stream_options': expected an object.")
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true.")
    return _flag(options, "include_usage", "stream_options.")


def _common(body: Any) -> tuple[str | None, bool, bool, SamplingParams, tuple[str, ...]]:
    if not isinstance(body, Mapping):
        raise invalid(None, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "Invalid type for 'model': expected a string.")
    _only_one(body, "n")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, Mapping) or response_format.get("type") != "text"
    ):
        raise invalid("response_format", "Only response_format of type 'text' is supported.")
    stream = _flag(body, "stream")
    include_usage = _stream_options(body, stream)
    return model, stream, include_usage, _sampling(body), _stop(body)


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"Invalid type for '{where}': expected a string or a list of parts.")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise invalid(f"{where}[{j}]", "Only content parts of type 'text' are supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{j}].text", "Invalid type: expected a string.")
        texts.append(text)
    return "".join(texts)


def _messages(body: Mapping[str, Any]) -> tuple[Message, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages", "'messages' is required and must be a list.")
    if not messages:
        raise invalid("messages", "'messages' must hold at least one message.")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise invalid(f"messages[{i}]", "Invalid type: expected an object.")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(
                f"messages[{i}].role", f"Invalid value: must be one of {', '.join(sorted(ROLES))}."
            )
        parsed.append(Message(role, _content(message.get("content"), f"messages[{i}].content")))
    return tuple(parsed)


def parse_chat(body: Any) -> ParsedRequest:
    """A /v1/chat/completions body, checked."""
    model, stream, include_usage, sampling, stop = _common(body)
    if body.get("logprobs") or body.get("top_logprobs"):
        param = "logprobs" if body.get("logprobs") else "top_logprobs"
        raise invalid(param, "logprobs are not supported.")
    tools = body.get("tools")
    if tools:
        raise invalid("tools", "Tools are not supported.")
    messages = _messages(body)
    request = GenerateRequest(model or "", messages=messages, sampling=sampling, stop=stop)
    return ParsedRequest(model, request, stream, include_usage)


def parse_completion(body: Any) -> ParsedRequest:
    """A /v1/completions body, checked."""
    model, stream, include_usage, sampling, stop = _common(body)
    _only_one(body, "best_of")
    if body.get("logprobs") is not None:
        raise invalid("logprobs", "logprobs are not supported.")
    if _flag(body, "echo"):
        raise invalid("echo", "echo is not supported.")
    if body.get("suffix"):
        raise invalid("suffix", "suffix is not supported.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' is required and must be one string.")
    request = GenerateRequest(model or "", prompt=prompt, sampling=sampling, stop=stop)
    return ParsedRequest(model, request, stream, include_usage)
