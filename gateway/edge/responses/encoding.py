"""The Responses API's answers: the response object, whole, or as its stream of
events, each with its `sequence_number`.

A stream goes `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its content (a message: `response.content_part.added`,
`response.output_text.delta`..., `.done`, `response.content_part.done`; a function
call: `response.function_call_arguments.delta`..., `.done`; a reasoning item: as a
message's, with `response.reasoning_text.*`, or, with `reasoning.summary` asked, as
its one summary part: `response.reasoning_summary_part.added`,
`response.reasoning_summary_text.delta`..., `.done`, `response.reasoning_summary_part.done`),
`response.output_item.done`; a compacting answer's summary (`context_management`: routes.py)
is a `compaction` item first, made whole at once (`response.output_item.added`,
`response.compaction.compacting`, `response.output_item.done`);
and last `response.completed` (or `response.incomplete` when `max_output_tokens` cut
it, or `error` and `response.failed` when the worker failed). An item is open until
the next one starts or the answer ends. The text delta, the event of every token, is
bytes around the JSON-escaped text (its template made once per response); the rest
are built as dicts, a few per response.

The encoder keeps the answer's output items: `final` is the response object once the
answer is over, which the route stores. What a request asks beyond the plain answer is
chosen once, when its encoder is made (a summary's event names, an encoder class for
logprobs, one for padding), so a request that asks none of it runs none of it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.edge.compacting import Compacted
from gateway.edge.errors import APIError
from gateway.edge.mcp.turns import McpApproval, McpCallEnded, McpCallStarted, McpListed
from gateway.edge.openai.encoding import MIN_LOGPROB, Encoder, obfuscated, token_bytes
from gateway.edge.responses.mcp import APPROVAL_REQUEST, CALL, LIST_TOOLS
from gateway.edge.responses.params import (
    COMPACTION,
    ResponsesBody,
    new_id,
    opaque,
    output_item_id,
)
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    Reasoning,
    Text,
    TokenLogprob,
    ToolCallDelta,
)

_SECRET = secrets.token_hex(8)
_SEQ = "\x00seq-" + _SECRET
_TEXT = "\x00text-" + _SECRET
_SEQ_JSON, _TEXT_JSON = orjson.dumps(_SEQ), orjson.dumps(_TEXT)
#: The MCP steps' events (gateway/edge/mcp/turns.py), which the events path renders as their items.
MCP_EVENTS = (McpListed, McpCallStarted, McpCallEnded, McpApproval)


def event(kind: str, fields: dict[str, Any]) -> bytes:
    """One SSE event of type `kind` (its `sequence_number` among `fields`)."""
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


def usage(
    prompt_tokens: int, completion_tokens: int, reasoning_tokens: int = 0, cached_tokens: int = 0
) -> dict[str, Any]:
    """The response's `usage`, in OpenAI's shape: the prompt's tokens the engine found in
    its prefix cache among the input's (0 where it said none)."""
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Call:
    """A function call of the answer, as its pieces come: a namespace's function by its
    own `name` and its `namespace` (the model called it by its flat name)."""

    __slots__ = ("arguments", "call_id", "id", "name", "namespace", "output_index")

    def __init__(
        self, response_id: str, call_id: str, name: str, output_index: int, namespace: str = ""
    ) -> None:
        self.id = output_item_id("fc", response_id, output_index)
        self.call_id = call_id
        self.name = name
        self.namespace = namespace
        self.output_index = output_index
        self.arguments: list[str] = []

    def item(self, status: str) -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "".join(self.arguments),
            "status": status,
        }
        if self.namespace:
            item["namespace"] = self.namespace
        return item


class _Thought:
    """A reasoning item of the answer, as its pieces come."""

    __slots__ = ("id", "output_index", "pieces")

    def __init__(self, response_id: str, output_index: int) -> None:
        self.id = output_item_id("rs", response_id, output_index)
        self.output_index = output_index
        self.pieces: list[str] = []

    def item(self, status: str, summary: bool, sealed: bool) -> dict[str, Any]:
        """vLLM's reasoning item: the text whole, as one `reasoning_text` part; with a
        `summary` asked, the text whole as its one `summary_text` part instead (the
        models do not summarize; the text is not sent twice); `sealed`: with its
        `encrypted_content`."""
        text = "".join(self.pieces)
        item: dict[str, Any] = {"type": "reasoning", "id": self.id}
        if summary:
            item["summary"] = [_summary_part(text)]
        else:
            item["summary"] = []
            item["content"] = [_reasoning_part(text)]
        if sealed:
            item["encrypted_content"] = opaque(text)
        item["status"] = status
        return item


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


class ResponsesEncoder(Encoder):
    """One response: its stream's events, or the whole object, from the worker's events.

    It serves the generation route's two paths as an `Encoder` of its own making (none
    of the chat templates): `plain` (no tools: `opening`, `delta` per batch of text,
    `closing`; or `response` whole) and the events path (`events` per batch, `end`; or
    `add` then `answer`). `request` is the route's, kept for storing the answer."""

    def __init__(  # no super().__init__(): the chat templates are not this API's
        self, model: str, body: ResponsesBody, response_id: str, request: Any = None
    ) -> None:
        self.request = request
        self.id = response_id
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        # an answer that may compact reads its `Compacted` in the events path
        self.plain = not body.tools and not body.mcp and body.compact_threshold is None
        self._mcp_call: dict[str, Any] | None = None  # the MCP call running now
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items done
        self._message_id = ""  # the open message's id ("": none open)
        self._message_index = 0
        self._pieces: list[str] = []
        self._calls: dict[int, _Call] = {}
        self._open_call: _Call | None = None
        self._thought: _Thought | None = None  # the open reasoning item
        # a reasoning delta's event and its index's name: the summary's, where one is asked
        self._summary = body.summary is not None
        self._sealed = body.encrypted
        self._thought_delta, self._thought_index = (
            ("response.reasoning_summary_text.delta", "summary_index")
            if self._summary
            else ("response.reasoning_text.delta", "content_index")
        )
        self.reasoning_tokens = 0
        self._finish_reason: FinishReason | None = None
        #: The response object once the answer is over (or failed).
        self.final: dict[str, Any] | None = None
        self._delta_head = self._delta_between = self._delta_tail = b""

    # -- building blocks --------------------------------------------------------

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        out = event(kind, {"sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def _object(
        self,
        status: str,
        prompt_tokens: int | None = None,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": list(self.output),
            **self.body.echo,
            "usage": None
            if prompt_tokens is None
            else usage(prompt_tokens, completion_tokens, self.reasoning_tokens, cached_tokens),
        }

    def _open_message(self) -> bytes:
        self._message_index = len(self.output)  # the items before it are done
        self._message_id = output_item_id("msg", self.id, self._message_index)
        self._pieces = []
        item = {
            "type": "message",
            "id": self._message_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        where = {"item_id": self._message_id, "output_index": self._message_index}
        # the text delta's bytes but its sequence number and its text
        template = event(
            "response.output_text.delta",
            {"sequence_number": _SEQ, **where, "content_index": 0, "delta": _TEXT, "logprobs": []},
        )
        self._delta_head, rest = template.split(_SEQ_JSON, 1)
        self._delta_between, self._delta_tail = rest.split(_TEXT_JSON, 1)
        return self._event(
            "response.output_item.added", {"output_index": self._message_index, "item": item}
        ) + self._event(
            "response.content_part.added",
            {**where, "content_index": 0, "part": self._part("")},
        )

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message_item(self, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": [self._part("".join(self._pieces))],
        }

    def _close_message(self, status: str, stream: bool = True) -> bytes:
        """The open message's closing events (none open: nothing)."""
        if not self._message_id:
            return b""
        item = self._message_item(status)
        self.output.append(item)
        self._message_id = ""
        if not stream:
            return b""
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": self._message_index, "content_index": 0}
        done = {**where, "text": part["text"], "logprobs": self._done_logprobs()}
        return (
            self._event("response.output_text.done", done)
            + self._event("response.content_part.done", {**where, "part": part})
            + self._event(
                "response.output_item.done", {"output_index": self._message_index, "item": item}
            )
        )

    def _done_logprobs(self) -> list[dict[str, Any]]:
        """`response.output_text.done`'s logprobs: none asked, none."""
        return []

    def _close_call(self, status: str, stream: bool = True) -> bytes:
        """The open call's closing events (none open: nothing); `incomplete` when the
        answer was cut or failed, its arguments perhaps not whole."""
        call = self._open_call
        if call is None:
            return b""
        self._open_call = None
        item = call.item(status)
        self.output.append(item)
        if not stream:
            return b""
        where = {"item_id": call.id, "output_index": call.output_index}
        return self._event(
            "response.function_call_arguments.done",
            {**where, "name": call.name, "arguments": item["arguments"]},
        ) + self._event(
            "response.output_item.done", {"output_index": call.output_index, "item": item}
        )

    def _think(self, text: str, tokens: int, stream: bool) -> bytes:
        """A piece of reasoning: in the open reasoning item, or one opened for it
        (closing the message or the call before it)."""
        self.reasoning_tokens += tokens
        if not text:
            return b""
        out = b""
        thought = self._thought
        if thought is None:
            out = self._close_item("completed", stream)
            thought = self._thought = _Thought(self.id, len(self.output))
            if stream:
                added = {
                    "type": "reasoning",
                    "id": thought.id,
                    "summary": [],
                    "status": "in_progress",
                }
                where = {"item_id": thought.id, "output_index": thought.output_index}
                out += self._event(
                    "response.output_item.added",
                    {"output_index": thought.output_index, "item": added},
                ) + (
                    self._event(
                        "response.reasoning_summary_part.added",
                        {**where, "summary_index": 0, "part": _summary_part("")},
                    )
                    if self._summary
                    else self._event(
                        "response.content_part.added",
                        {**where, "content_index": 0, "part": _reasoning_part("")},
                    )
                )
        thought.pieces.append(text)
        if not stream:
            return out
        return out + self._event(
            self._thought_delta,
            {
                "item_id": thought.id,
                "output_index": thought.output_index,
                self._thought_index: 0,
                "delta": text,
            },
        )

    def _close_item(self, status: str, stream: bool = True) -> bytes:
        """The open item's closing events, whichever it is (one is open at a time)."""
        return (
            self._close_thought(status, stream)
            + self._close_message(status, stream)
            + self._close_call(status, stream)
        )

    def _close_thought(self, status: str, stream: bool = True) -> bytes:
        """The open reasoning item's closing events (none open: nothing)."""
        thought = self._thought
        if thought is None:
            return b""
        self._thought = None
        item = thought.item(status, self._summary, self._sealed)
        self.output.append(item)
        if not stream:
            return b""
        where = {"item_id": thought.id, "output_index": thought.output_index}
        if self._summary:
            part = item["summary"][0]
            where["summary_index"] = 0
            # OpenAI marks a summary cut short; one that completed has no status
            cut = {} if status == "completed" else {"status": "incomplete"}
            out = self._event(
                "response.reasoning_summary_text.done", {**where, "text": part["text"]}
            ) + self._event("response.reasoning_summary_part.done", {**where, "part": part, **cut})
        else:
            part = item["content"][0]
            where["content_index"] = 0
            out = self._event(
                "response.reasoning_text.done", {**where, "text": part["text"]}
            ) + self._event("response.content_part.done", {**where, "part": part})
        return out + self._event(
            "response.output_item.done", {"output_index": thought.output_index, "item": item}
        )

    def _heading(self) -> bytes:
        """`response.created` and `response.in_progress`, once."""
        if self.seq:
            return b""
        snapshot = self._object("in_progress")
        return self._event("response.created", {"response": snapshot}) + self._event(
            "response.in_progress", {"response": snapshot}
        )

    def _status(self) -> str:
        return "incomplete" if self._finish_reason is FinishReason.LENGTH else "completed"

    def _finish(
        self, prompt_tokens: int, completion_tokens: int, stream: bool, cached_tokens: int = 0
    ) -> bytes:
        status = self._status()
        item_status = "incomplete" if status == "incomplete" else "completed"
        out = self._close_item(item_status, stream)
        self.final = self._object(status, prompt_tokens, completion_tokens, cached_tokens)
        if not stream:
            return b""
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": self.final})

    # -- the plain path: one message of text ----------------------------------------

    def opening(self) -> bytes:
        """The stream's head, before its first text (or reasoning)."""
        return self._heading()

    def delta(self, text: str) -> bytes:
        """A `response.output_text.delta` carrying `text`, after the message's opening
        where none is open (closing the reasoning before it)."""
        opening = b""
        if not self._message_id:
            opening = self._close_thought("completed") + self._open_message()
        self._pieces.append(text)
        seq = self.seq
        self.seq += 1
        return (
            opening
            + self._delta_head
            + str(seq).encode()
            + self._delta_between
            + orjson.dumps(text)
            + self._delta_tail
        )

    def reasoning_chunk(self, event: Reasoning) -> bytes:
        """A `response.reasoning_text.delta` carrying a piece of reasoning."""
        return self._think(event.text, event.tokens, True)

    def closing(
        self,
        reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
    ) -> bytes:
        """The open item's closing events and the response's last event: an answer
        with neither text nor reasoning still has its (empty) message."""
        self._finish_reason = reason
        opening = self._open_message() if self._said_nothing() else b""
        finish = self._finish(prompt_tokens, completion_tokens, True, cached_tokens)
        return self._heading() + opening + finish

    def _said_nothing(self) -> bool:
        """Whether the answer has neither an item nor one open: it ends with an (empty)
        message."""
        return not self._message_id and self._thought is None and not self.output

    def response(
        self,
        text: str,
        reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning: Sequence[Reasoning] = (),
        cached_tokens: int = 0,
    ) -> bytes:
        """The whole response object of a plain answer: its reasoning item, if any,
        then its message (left out where reasoning was all it said)."""
        self._finish_reason = reason
        for piece in reasoning:
            self._think(piece.text, piece.tokens, False)
        if text or not reasoning:
            self._close_thought("completed", False)
            self._message_index = len(self.output)
            self._message_id = output_item_id("msg", self.id, self._message_index)
            self._pieces = [text]
        self._finish(prompt_tokens, completion_tokens, False, cached_tokens)
        return orjson.dumps(self.final)

    # -- the events path: text and function calls -------------------------------------

    def _take(self, batch: list[Event], stream: bool) -> bytes:
        out = [self._heading()] if stream else []
        for item in batch:
            if isinstance(item, Text):
                if not item.text:
                    continue
                if not self._message_id:
                    out.append(self._close_item("completed", stream))
                    opening = self._open_message()
                    if stream:
                        out.append(opening)
                out.append(self.delta(item.text) if stream else b"")
                if not stream:
                    self._pieces.append(item.text)
            elif isinstance(item, Reasoning):
                out.append(self._think(item.text, item.tokens, stream))
            elif isinstance(item, ToolCallDelta):
                out.append(self._call_piece(item, stream))
            elif isinstance(item, Finished):
                self._finish_reason = item.reason
            elif isinstance(item, MCP_EVENTS):
                out.append(self._mcp(item, stream))
            elif isinstance(item, Compacted):
                out.append(self._compaction(item, stream))
        return b"".join(out)

    def _compaction(self, compacted: Compacted, stream: bool) -> bytes:
        """The summary of a compacting answer as its `compaction` output item, made whole
        at once (none where the model wrote no summary: the answer goes on from the whole
        prompt)."""
        if compacted.summary is None:
            return b""
        out = self._close_item("completed", stream)
        index = len(self.output)
        item = {
            "type": COMPACTION,
            "id": output_item_id("cmp", self.id, index),
            "encrypted_content": opaque(compacted.summary),
        }
        return out + self._whole_item(item, index, stream, ("compacting",))

    # -- remote MCP servers' items (gateway/edge/mcp/turns.py) -------------------------------------

    def _mcp(self, event: Any, stream: bool) -> bytes:
        """An MCP step as its output item: a listing, a call (opened, then ended), an
        approval asked; each after the item open before it is closed."""
        if isinstance(event, McpCallEnded):
            return self._mcp_ended(event, stream)
        out = self._close_item("completed", stream)
        index = len(self.output)
        if isinstance(event, McpListed):
            item = {
                "type": LIST_TOOLS,
                "id": output_item_id("mcpl", self.id, index),
                "server_label": event.label,
                "tools": [tool.shown() for tool in event.tools],
                "error": None,
            }
            return out + self._whole_item(item, index, stream, ("in_progress", "completed"))
        if isinstance(event, McpApproval):
            item = {
                "type": APPROVAL_REQUEST,
                "id": output_item_id("mcpr", self.id, index),
                "server_label": event.label,
                "name": event.name,
                "arguments": event.arguments,
            }
            return out + self._whole_item(item, index, stream, ())
        item = self._mcp_call = {
            "type": CALL,
            "id": output_item_id("mcp", self.id, index),
            "status": "in_progress",
            "server_label": event.label,
            "name": event.name,
            "arguments": event.arguments,
            "output": None,
            "error": None,
            "approval_request_id": event.approval_request_id,
        }
        self.output.append(item)
        if not stream:
            return out
        where = {"item_id": item["id"], "output_index": index}
        arguments = event.arguments
        return (
            out
            + self._event("response.output_item.added", {"output_index": index, "item": item})
            + self._event("response.mcp_call.in_progress", where)
            + self._event("response.mcp_call_arguments.delta", {**where, "delta": arguments})
            + self._event("response.mcp_call_arguments.done", {**where, "arguments": arguments})
        )

    def _whole_item(
        self, item: dict[str, Any], index: int, stream: bool, steps: tuple[str, ...]
    ) -> bytes:
        """An item made whole at once: added, its steps' events, done."""
        self.output.append(item)
        if not stream:
            return b""
        where = {"item_id": item["id"], "output_index": index}
        out = self._event("response.output_item.added", {"output_index": index, "item": item})
        for step in steps:
            out += self._event(f"response.{item['type']}.{step}", where)
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def _mcp_ended(self, event: McpCallEnded, stream: bool) -> bytes:
        item = self._mcp_call
        if item is None:
            return b""
        self._mcp_call = None
        failed = event.error is not None
        item.update(
            status="failed" if failed else "completed", output=event.output, error=event.error
        )
        if not stream:
            return b""
        index = self.output.index(item)
        where = {"item_id": item["id"], "output_index": index}
        step = "response.mcp_call.failed" if failed else "response.mcp_call.completed"
        return self._event(step, where) + self._event(
            "response.output_item.done", {"output_index": index, "item": item}
        )

    def _call_piece(self, piece: ToolCallDelta, stream: bool) -> bytes:
        out = b""
        call = self._calls.get(piece.call_index)
        if call is None:
            out = self._close_item("completed", stream)
            index = len(self.output)
            call_id = piece.id or new_id("call")
            namespace, name = self.body.namespaced.get(piece.name, ("", piece.name))
            call = self._calls[piece.call_index] = _Call(self.id, call_id, name, index, namespace)
            self._open_call = call
            if stream:
                out += self._event(
                    "response.output_item.added",
                    {"output_index": index, "item": call.item("in_progress")},
                )
        if not piece.arguments:
            return out
        call.arguments.append(piece.arguments)
        if not stream:
            return out
        return out + self._event(
            "response.function_call_arguments.delta",
            {"item_id": call.id, "output_index": call.output_index, "delta": piece.arguments},
        )

    def events(self, batch: list[Event]) -> bytes:
        """The stream events of a batch of the worker's events."""
        return self._take(batch, True)

    def end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The last items' closing events and the response's last event."""
        finish = self._finish(prompt_tokens, completion_tokens, True, cached_tokens)
        return self._heading() + finish

    def add(self, batch: list[Event]) -> None:
        """Gathers a batch of events for `answer`."""
        self._take(batch, False)

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The whole response object from what `add` gathered."""
        self._finish(prompt_tokens, completion_tokens, False, cached_tokens)
        return orjson.dumps(self.final)

    # -- failure ----------------------------------------------------------------------

    def failure(self, error: APIError) -> bytes:
        """After the stream began, the worker failed: an `error` event, then
        `response.failed` with what was said so far (the head first, if it has not gone
        out)."""
        out = self._heading() + self._close_item("incomplete")
        failed = self._object("failed")
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        self.final = failed
        fields = {"code": error.code, "message": error.message, "param": error.param}
        return (
            out
            + self._event("error", fields)
            + self._event("response.failed", {"response": failed})
        )


def _last_obfuscated(events: bytes) -> bytes:
    """`events` with the last of them `obfuscated` (an event's JSON never holds a blank
    line: the events end where `\\n\\n` is)."""
    start = events.rfind(b"\n\n", 0, len(events) - 2) + 2
    if start == 1:  # the only one
        start = 0
    return events[:start] + obfuscated(events[start:])


class ObfuscatedResponsesEncoder(ResponsesEncoder):
    """A response whose stream's delta events (`response.output_text.delta`,
    `response.reasoning_text.delta` or `response.reasoning_summary_text.delta`,
    `response.function_call_arguments.delta`) carry
    OpenAI's `obfuscation` padding (`stream_options.include_obfuscation`), as OpenAI
    pads the delta events alone (the others come once an item, not once a token). A class
    of its own, chosen once per request, so a stream that does not ask runs none of it.
    Each method that makes a delta event makes it last, after the events that open its
    item."""

    def delta(self, text: str) -> bytes:
        return _last_obfuscated(super().delta(text))

    def _think(self, text: str, tokens: int, stream: bool) -> bytes:
        out = super()._think(text, tokens, stream)
        return _last_obfuscated(out) if stream and text else out

    def _call_piece(self, piece: ToolCallDelta, stream: bool) -> bytes:
        out = super()._call_piece(piece, stream)
        return _last_obfuscated(out) if stream and piece.arguments else out


def _top(token: TokenLogprob, with_bytes: bool) -> list[dict[str, Any]]:
    if with_bytes:
        return [
            {"token": t, "bytes": token_bytes(t), "logprob": max(lp, MIN_LOGPROB)}
            for t, lp in token.top
        ]
    return [{"token": t, "logprob": max(lp, MIN_LOGPROB)} for t, lp in token.top]


def part_logprobs(tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """An `output_text` part's `logprobs` (OpenAI's `Logprob`: with the tokens' bytes)."""
    return [
        {
            "token": token.token,
            "bytes": token_bytes(token.token),
            "logprob": max(token.logprob, MIN_LOGPROB),
            "top_logprobs": _top(token, True),
        }
        for token in tokens
    ]


def event_logprobs(tokens: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """A text event's `logprobs` (`response.output_text.delta` and `.done`: OpenAI's
    shape there has no bytes)."""
    return [
        {
            "token": token.token,
            "logprob": max(token.logprob, MIN_LOGPROB),
            "top_logprobs": _top(token, False),
        }
        for token in tokens
    ]


class LogprobsResponsesEncoder(ResponsesEncoder):
    """A response with its text's logprobs (`include: ["message.output_text.logprobs"]`):
    on each `response.output_text.delta`, on `.done`, and on the `output_text` part. It
    takes the events path (a plain text carries no logprobs), its texts read here, the
    rest as the events path reads them; a class of its own, so an answer without
    logprobs runs none of it."""

    def __init__(
        self, model: str, body: ResponsesBody, response_id: str, request: Any = None
    ) -> None:
        super().__init__(model, body, response_id, request)
        self.plain = False
        self._tokens: list[TokenLogprob] = []  # the open message's
        self._logprobs_key = b""

    def _open_message(self) -> bytes:
        out = super()._open_message()
        self._tokens = []
        # the delta's template ends `"logprobs":[]}`: its logprobs go where `[]` is
        self._delta_tail, self._logprobs_key = (b"}\n\n", self._delta_tail[: -len(b"[]}\n\n")])
        return out

    def _message_item(self, status: str) -> dict[str, Any]:
        item = super()._message_item(status)
        item["content"][0]["logprobs"] = part_logprobs(self._tokens)
        return item

    def _done_logprobs(self) -> list[dict[str, Any]]:
        return event_logprobs(self._tokens)

    def _finish(
        self, prompt_tokens: int, completion_tokens: int, stream: bool, cached_tokens: int = 0
    ) -> bytes:
        """As the plain path ends: an answer without tools that said nothing still has
        its (empty) message."""
        opening = b""
        if self._said_nothing() and not self.body.tools:
            opening = self._open_message()
        return (opening if stream else b"") + super()._finish(
            prompt_tokens, completion_tokens, stream, cached_tokens
        )

    def _take(self, batch: list[Event], stream: bool) -> bytes:
        out = [self._heading()] if stream else []
        for item in batch:
            if type(item) is Text:
                out.append(self._text(item, stream))
            else:
                out.append(super()._take([item], stream))
        return b"".join(out)

    def _text(self, piece: Text, stream: bool) -> bytes:
        """A piece of text and its tokens' logprobs (a piece may have tokens and no text
        yet: a character's first bytes), in the open message or one opened for it."""
        tokens = piece.logprobs or ()
        if not piece.text and not tokens:
            return b""
        out = b""
        if not self._message_id:
            out = self._close_item("completed", stream)
            opening = self._open_message()
            if stream:
                out += opening
        self._pieces.append(piece.text)
        self._tokens += tokens
        if not stream:
            return out
        return out + self._logprob_delta(piece.text, tokens)

    def _logprob_delta(self, text: str, tokens: Sequence[TokenLogprob]) -> bytes:
        seq = self.seq
        self.seq += 1
        return (
            self._delta_head
            + str(seq).encode()
            + self._delta_between
            + orjson.dumps(text)
            + self._logprobs_key
            + orjson.dumps(event_logprobs(tokens))
            + self._delta_tail
        )


class ObfuscatedLogprobsResponsesEncoder(LogprobsResponsesEncoder, ObfuscatedResponsesEncoder):
    """Logprobs, and the stream's delta events padded."""

    def _logprob_delta(self, text: str, tokens: Sequence[TokenLogprob]) -> bytes:
        return obfuscated(super()._logprob_delta(text, tokens))


def encoder_type(body: ResponsesBody) -> type[ResponsesEncoder]:
    """The encoder class of a request: what it asks of the stream, chosen once."""
    if body.logprobs is not None:
        return ObfuscatedLogprobsResponsesEncoder if body.obfuscate else LogprobsResponsesEncoder
    return ObfuscatedResponsesEncoder if body.obfuscate else ResponsesEncoder
