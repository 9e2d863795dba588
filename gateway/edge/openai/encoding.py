"""OpenAI response bodies: whole JSON answers, and SSE chunks from templates.

Each stream serializes its chunk once with a placeholder for the delta and
keeps the bytes before and after it; a chunk is then those bytes around the
JSON-escaped delta. Nothing else is built per token.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, ClassVar

import orjson

from gateway.protocol.types import FinishReason

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
_PLACEHOLDER = "\x00delta-" + secrets.token_hex(8)
_PLACEHOLDER_JSON = orjson.dumps(_PLACEHOLDER)


def sse(payload: Any) -> bytes:
    """One SSE event holding `payload` as JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Encoder:
    """One response's bodies; subclasses say how a choice looks."""

    id_prefix: ClassVar[str]
    object_full: ClassVar[str]
    object_chunk: ClassVar[str]

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        template = self._chunk(self.delta_choice(_PLACEHOLDER), None)
        self._before, self._after = template.split(_PLACEHOLDER_JSON, 1)

    def _head(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any], reason: FinishReason | None) -> bytes:
        chunk = self._head(self.object_chunk)
        finish = None if reason is None else reason.value
        chunk["choices"] = [{"index": 0, **choice, "finish_reason": finish}]
        if self.include_usage:
            chunk["usage"] = None
        return sse(chunk)

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        """A stream choice carrying `text` (None: carrying nothing)."""
        raise NotImplementedError

    def full_choice(self, text: str) -> dict[str, Any]:
        """A whole answer's choice."""
        raise NotImplementedError

    def opening(self) -> bytes:
        """What a stream sends before the first text."""
        return b""

    def delta(self, text: str) -> bytes:
        """A chunk carrying `text`."""
        return self._before + orjson.dumps(text) + self._after

    def closing(self, reason: FinishReason, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last chunk, the usage chunk if asked for, and [DONE]."""
        out = self._chunk(self.delta_choice(None), reason)
        if self.include_usage:
            usage = self._head(self.object_chunk)
            usage["choices"] = []
            usage["usage"] = _usage(prompt_tokens, completion_tokens)
            out += sse(usage)
        return out + DONE

    def response(
        self, text: str, reason: FinishReason, prompt_tokens: int, completion_tokens: int
    ) -> bytes:
        """A whole, non-streamed answer."""
        body = self._head(self.object_full)
        body["choices"] = [{"index": 0, **self.full_choice(text), "finish_reason": reason.value}]
        body["usage"] = _usage(prompt_tokens, completion_tokens)
        return orjson.dumps(body)


class ChatEncoder(Encoder):
    """/v1/chat/completions."""

    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        return {"delta": {} if text is None else {"content": text}, "logprobs": None}

    def full_choice(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}, "logprobs": None}

    def opening(self) -> bytes:
        """Chat streams open with the assistant's role and empty content."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None}, None)


class CompletionEncoder(Encoder):
    """/v1/completions."""

    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        return {"text": text or "", "logprobs": None}

    def full_choice(self, text: str) -> dict[str, Any]:
        return {"text": text, "logprobs": None}
