"""Anthropic Messages answers: the whole `message` object, and the stream of
Anthropic's named SSE events, from our events.

A stream goes `message_start` (with the prompt's tokens when the worker said
them in `Started`) and a `ping`; then for each block of the answer, thinking (a
reasoning model's reasoning, as vLLM's own Messages server shows it), text or a
tool call, `content_block_start`, its `content_block_delta`s (`thinking_delta` and,
last, a `signature_delta`; `text_delta`; or `input_json_delta` with a piece of the
call's arguments) and `content_block_stop`; then `message_delta` (the `stop_reason`, `stop_sequence`
when the worker says which stop string ended the answer, and the usage) and
`message_stop`. A failure after the head is an `error` event. A text delta is
built from pre-serialized bytes around the JSON-escaped text: no dict per token.

The route runs this encoder through the OpenAI routes' machinery
(`gateway.edge.openai.generation`): it is an `Encoder` that is never `plain`,
so the route hands it every batch of events (`events`, `end` for streams; `add`,
`answer` for whole answers).
"""

from __future__ import annotations

import secrets
from typing import Any

import jiter
import orjson

from gateway.edge.anthropic.context_editing import Applied, applied_edits
from gateway.edge.anthropic.errors import error_payload
from gateway.edge.compacting import Compacted
from gateway.edge.errors import APIError
from gateway.edge.mcp.turns import McpCallEnded, McpCallStarted
from gateway.edge.openai.encoding import Encoder
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    Reasoning,
    Started,
    Text,
    ToolCallDelta,
)

#: Our finish reasons → Anthropic's stop_reason.
STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
}


def event(name: str, payload: Any) -> bytes:
    """One named SSE event holding `payload` as JSON."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


_PING = event("ping", {"type": "ping"})
_MESSAGE_STOP = event("message_stop", {"type": "message_stop"})
_TEXT_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
_TEXT_MIDDLE = b',"delta":{"type":"text_delta","text":'
_TEXT_END = b"}}\n\n"


def _signature() -> str:
    """A thinking block's `signature`: Anthropic's proves its thinking unaltered; here,
    as vLLM's server gives it, an opaque value a client keeps and sends back."""
    return secrets.token_hex(16)


def _tool_id(given: str) -> str:
    return given or f"toolu_{secrets.token_hex(12)}"


def _input(arguments: str) -> Any:
    """A call's arguments as the object Anthropic's `input` is. Arguments cut short
    (by `max_tokens`) are read as far as they go, as Anthropic's SDK reads a stream's
    `input_json_delta`s (jiter's partial mode: an unfinished string is left out), so a
    whole answer and a stream give the client the same `input`; text that is not JSON
    at all (a model's malformed call) stays text, for the client to see."""
    try:
        return jiter.from_json((arguments or "{}").encode(), partial_mode=True)
    except ValueError:
        return arguments


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: its input is the three input counts summed, so `input_tokens`
    are the prompt's tokens the engine did not find in its prefix cache, as vLLM's
    Messages server counts them; the cache is only read here, never written apart."""
    return {
        "input_tokens": max(0, prompt_tokens - cached_tokens),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


class MessagesEncoder(Encoder):
    """One /v1/messages answer (one choice: Anthropic has no `n`)."""

    def __init__(
        self, model: str, include_usage: bool = False, *, reasoning: bool = True, **_: Any
    ) -> None:
        # Nothing of the OpenAI templates is used: the route calls only the methods below.
        self.id = f"msg_{secrets.token_hex(12)}"
        self.model = model
        self.plain = False
        self.reason: FinishReason | None = None
        self.stop_sequence: str | None = None  # the stop string that ended the answer
        self.input_tokens = 0
        self.cached_tokens = 0  # of the input's, as `Started` said them (message_start)
        self.show_reasoning = reasoning  # False: thinking left out (`thinking` disabled)
        #: `thinking.display: "omitted"`: each thinking block without its text, as
        #: Anthropic's API answers it (its signature kept for the client to send back).
        self.omit_thinking = False
        self.reasoning_tokens = 0
        # streams: whether message_start went out, the open block's index and kind
        self._started = False
        self._index = -1
        self._open: str | int | None = None  # "text", "thinking", a call's index, or None
        # whole answers: the blocks, each [kind, pieces...] ("text", "thinking") or
        # ["tool_use", id, name, arguments pieces...]
        self._blocks: list[list[str]] = []
        self._calls: dict[int, list[str]] = {}
        # `context_management`: the edits that cleared something (None: not asked)
        self.applied: tuple[Applied, ...] | None = None
        # the MCP connector's call under way: its `mcp_tool_use` block's id
        self._mcp_use = ""
        # the summary's turn of a compacting answer, once it ended (compaction.py)
        self._compacted: Compacted | None = None

    def _context_management(self, prompt_tokens: int) -> dict[str, Any]:
        """The answer's `context_management`: the edits that cleared something (the
        last, from the prompt it left: of a compacting answer, its summary's turn's)."""
        assert self.applied is not None
        if self._compacted is not None:
            prompt_tokens = self._compacted.prompt_tokens
        return {"applied_edits": applied_edits(self.applied, prompt_tokens)}

    def _message(self, usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }

    def _finished(self, finished: Finished) -> None:
        self.reason = finished.reason
        if finished.reason is FinishReason.STOP and finished.stop_sequence:
            self.stop_sequence = finished.stop_sequence

    def _stop_reason(self) -> str:
        if self.stop_sequence is not None:
            return "stop_sequence"
        if self._compacted is not None and self._compacted.paused:
            return "compaction"
        return STOP_REASONS[self.reason or FinishReason.STOP]

    def _usage(self, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """The answer's usage; of a compacting answer, less its summary's turn, which
        `iterations` report apart (first), as Anthropic's API reports a compaction."""
        compacted = self._compacted
        if compacted is None:
            return _usage(prompt_tokens, output_tokens, cached_tokens)
        summary = _usage(
            compacted.prompt_tokens, compacted.completion_tokens, compacted.cached_tokens
        )
        iterations: list[dict[str, Any]] = [{"type": "compaction", **summary}]
        if compacted.paused:
            usage = _usage(0, 0, 0)
        else:
            usage = _usage(
                prompt_tokens - compacted.prompt_tokens,
                output_tokens - compacted.completion_tokens,
                cached_tokens - compacted.cached_tokens,
            )
            iterations.append({"type": "message", **usage})
        return {**usage, "iterations": iterations}

    @staticmethod
    def _compaction_block(compacted: Compacted) -> dict[str, Any]:
        return {"type": "compaction", "content": compacted.summary, "encrypted_content": None}

    # streams

    def _close_block(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # its signature last, as Anthropic's stream gives it
            delta = {"type": "signature_delta", "signature": _signature()}
            payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
            out = event("content_block_delta", payload)
        self._open = None
        stop = {"type": "content_block_stop", "index": self._index}
        return out + event("content_block_stop", stop)

    def _open_block(self, key: str | int, block: dict[str, Any]) -> bytes:
        out = self._close_block()
        self._index += 1
        self._open = key
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + event("content_block_start", start)

    def events(self, batch: list[Event]) -> bytes:
        """The SSE events of a batch: message_start before anything, then blocks."""
        out = []
        if not self._started:
            self._started = True
            for item in batch:
                if isinstance(item, Started):
                    self.input_tokens = item.prompt_tokens
                    self.cached_tokens = item.cached_tokens
            head = self._message(_usage(self.input_tokens, 0, self.cached_tokens))
            out.append(event("message_start", {"type": "message_start", "message": head}) + _PING)
        for item in batch:
            if type(item) is Text:
                if not item.text:
                    continue
                if self._open != "text":
                    out.append(self._open_block("text", {"type": "text", "text": ""}))
                index = str(self._index).encode()
                text = orjson.dumps(item.text)
                out.append(_TEXT_DELTA + index + _TEXT_MIDDLE + text + _TEXT_END)
            elif type(item) is Reasoning:
                self.reasoning_tokens += item.tokens
                if not item.text or not self.show_reasoning:
                    continue
                if self._open != "thinking":
                    out.append(self._open_block("thinking", {"type": "thinking", "thinking": ""}))
                if self.omit_thinking:  # the block and its signature_delta only
                    continue
                delta = {"type": "thinking_delta", "thinking": item.text}
                payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
                out.append(event("content_block_delta", payload))
            elif isinstance(item, ToolCallDelta):
                if self._open != item.call_index:
                    block = {
                        "type": "tool_use",
                        "id": _tool_id(item.id),
                        "name": item.name,
                        "input": {},
                    }
                    out.append(self._open_block(item.call_index, block))
                if item.arguments:
                    delta = {"type": "input_json_delta", "partial_json": item.arguments}
                    payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
                    out.append(event("content_block_delta", payload))
            elif isinstance(item, Finished):
                self._finished(item)
                out.append(self._close_block())
            elif isinstance(item, McpCallStarted):
                block = {
                    "type": "mcp_tool_use",
                    "id": _tool_id(item.call_id),
                    "name": item.name,
                    "server_name": item.label,
                    "input": {},
                }
                self._mcp_use = block["id"]
                out.append(self._open_block("mcp", block))
                delta = {"type": "input_json_delta", "partial_json": item.arguments}
                payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
                out.append(event("content_block_delta", payload))
            elif isinstance(item, McpCallEnded):
                out.append(self._open_block("mcp", self._mcp_result(item)))
                out.append(self._close_block())
            elif isinstance(item, Compacted):
                # its whole summary in one delta: Anthropic's SDKs take a delta's content
                # as the block's, not as a piece of it
                self._compacted = item
                block = {**self._compaction_block(item), "content": None}
                out.append(self._open_block("compaction", block))
                delta = {**self._compaction_block(item), "type": "compaction_delta"}
                payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
                out.append(event("content_block_delta", payload))
                out.append(self._close_block())
        return b"".join(out)

    def _mcp_result(self, ended: McpCallEnded) -> dict[str, Any]:
        """The `mcp_tool_result` block of the MCP call that ended (its `mcp_tool_use`'s)."""
        text = ended.output if ended.error is None else ended.error
        return {
            "type": "mcp_tool_result",
            "tool_use_id": self._mcp_use,
            "is_error": ended.error is not None,
            "content": [{"type": "text", "text": text or ""}],
        }

    def end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """message_delta with the stop reason and the usage, and message_stop."""
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason(), "stop_sequence": self.stop_sequence},
            "usage": self._usage(prompt_tokens, completion_tokens, cached_tokens),
        }
        if self.applied is not None:
            delta["context_management"] = self._context_management(prompt_tokens)
        return self._close_block() + event("message_delta", delta) + _MESSAGE_STOP

    def failure(self, error: APIError) -> bytes:
        """A failure after the head: Anthropic's `error` event."""
        return event("error", error_payload(error.status, error.message))

    # whole answers

    def add(self, batch: list[Event]) -> None:
        """Gathers a batch of events for `answer`."""
        blocks = self._blocks
        for item in batch:
            if type(item) is Text:
                if not item.text:
                    continue
                if not blocks or blocks[-1][0] != "text":
                    blocks.append(["text"])
                blocks[-1].append(item.text)
            elif type(item) is Reasoning:
                self.reasoning_tokens += item.tokens
                if not item.text or not self.show_reasoning:
                    continue
                if not blocks or blocks[-1][0] != "thinking":
                    blocks.append(["thinking"])
                if not self.omit_thinking:
                    blocks[-1].append(item.text)
            elif isinstance(item, ToolCallDelta):
                call = self._calls.get(item.call_index)
                if call is None:
                    call = self._calls[item.call_index] = ["tool_use", _tool_id(item.id), item.name]
                    blocks.append(call)
                call.append(item.arguments)
            elif isinstance(item, Finished):
                self._finished(item)
            elif isinstance(item, McpCallStarted):
                self._mcp_use = _tool_id(item.call_id)
                use = {"id": self._mcp_use, "name": item.name, "server_name": item.label}
                blocks.append(["mcp_tool_use", orjson.dumps(use).decode(), item.arguments])
            elif isinstance(item, McpCallEnded):
                blocks.append(["mcp_tool_result", orjson.dumps(self._mcp_result(item)).decode()])
            elif isinstance(item, Compacted):
                self._compacted = item
                blocks.append(["compaction", orjson.dumps(self._compaction_block(item)).decode()])

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The whole `message` object."""
        content: list[dict[str, Any]] = []
        for block in self._blocks:
            if block[0] == "text":
                content.append({"type": "text", "text": "".join(block[1:])})
            elif block[0] == "thinking":
                thinking = "".join(block[1:])
                content.append(
                    {"type": "thinking", "thinking": thinking, "signature": _signature()}
                )
            elif block[0] == "mcp_tool_use":
                use = orjson.loads(block[1])
                content.append({"type": "mcp_tool_use", **use, "input": _input(block[2])})
            elif block[0] in ("mcp_tool_result", "compaction"):
                content.append(orjson.loads(block[1]))
            else:
                arguments = _input("".join(block[3:]))
                content.append(
                    {"type": "tool_use", "id": block[1], "name": block[2], "input": arguments}
                )
        if not content:
            content.append({"type": "text", "text": ""})
        body = self._message(self._usage(prompt_tokens, completion_tokens, cached_tokens))
        body["content"] = content
        body["stop_reason"] = self._stop_reason()
        body["stop_sequence"] = self.stop_sequence
        if self.applied is not None:
            body["context_management"] = self._context_management(prompt_tokens)
        return orjson.dumps(body)
