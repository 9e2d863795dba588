"""Our own request and event types: what the layers pass between them.

The edge builds a `GenerateRequest` from an OpenAI body; the engine client turns
it into protobuf and the worker's protobuf events back into these events; the
worker SDK hands the same types to engines. Events are small tuples because
one is made for every message a worker sends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class FinishReason(enum.Enum):
    """Why an answer ended; the values are OpenAI's `finish_reason`."""

    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message, its content already flattened to text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings; None means the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request for one answer: a text prompt or chat messages, never both."""

    model: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""


class Started(NamedTuple):
    """First event: the worker accepted the request."""

    prompt_tokens: int


class Text(NamedTuple):
    """A piece of the answer holding `tokens` tokens."""

    text: str
    tokens: int


class Finished(NamedTuple):
    """Last event: why the answer ended and how many tokens it took; the prompt's
    tokens too when the worker could not say them in `Started` (HTTP upstreams)."""

    reason: FinishReason
    completion_tokens: int
    prompt_tokens: int | None = None


Event = Started | Text | Finished
