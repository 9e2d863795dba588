"""OpenAI response bodies: whole JSON answers, and SSE chunks from templates.

Each stream serializes its chunks' head (id, object, created, model) once, and
each encoder class its text chunk's choices once with placeholders (the
choice's index, the delta, the logprobs), keeping the bytes between them; a
text chunk is then those bytes around the JSON-escaped delta, and every other
chunk the head's bytes before its serialized choices. The common answer, one choice
of plain text, takes the fast path (`plain`): `delta` per written batch and
nothing else built per token. Everything else (n choices, logprobs, tool
calls, a completion's echo, vLLM's usage on every chunk) reads the worker's events
choice by choice
(`events` for streams, `add` then `answer` for whole answers): text still goes
through the templates, one chunk per run of a choice's text in a batch; a
choice's opening, its finish and its tool calls' pieces are built as dicts.

vLLM's `return_token_ids` takes the events path too, its text chunks built as dicts:
the prompt's ids (the worker's `Started`) in a chat's top level (a stream's: each
choice's opening) or in each completion's choice (a stream's: its first chunk), and
every chunk's choice the ids of the events it was made of, so that a choice's chunks'
ids joined are all its tokens' (the end of sequence's in its finish chunk).

A stream that asks for OpenAI's padding (`stream_options.include_obfuscation`) has
encoder classes of their own (`OBFUSCATED`), which pad every chunk they make
(`obfuscated`): a stream that does not ask runs none of it.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import orjson

from gateway.edge.errors import APIError
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    Reasoning,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
_SECRET = secrets.token_hex(8)
_TEXT = "\x00delta-" + _SECRET
_INDEX = "\x00index-" + _SECRET
_LOGPROBS = "\x00logprobs-" + _SECRET
_TEXT_JSON, _INDEX_JSON, _LOGPROBS_JSON = map(orjson.dumps, (_TEXT, _INDEX, _LOGPROBS))
#: How a chunk's bytes end where its usage is null (the usage is its last key).
_NULL_END = b"null}\n\n"
#: A stream chunk's bytes after its choices: with a usage (null until the usage chunk)
#: where the stream includes usage, without one otherwise.
_USAGE_NULL_END = b',"usage":' + _NULL_END
_END = b"}\n\n"
#: OpenAI's floor for a logprob (vLLM's too): -inf is not JSON.
MIN_LOGPROB = -9999.0

#: A token's logprob and where it starts in its choice's text (completions' text_offset).
Logprob = tuple[TokenLogprob, int]


#: What a padding's random base64 characters become: alphanumeric, as OpenAI's are.
_ALPHANUMERIC = bytes.maketrans(b"-_", b"xQ")
#: The padding's bucket, in bytes: a chunk and its padding end on a multiple of it, plus
#: a random tail of less than it.
PAD_BUCKET = 16


def obfuscated(chunk: bytes) -> bytes:
    """`chunk` (one SSE event, its JSON object last, as `}\\n\\n`) with OpenAI's
    `obfuscation` key last in the object: random alphanumeric characters, as many as
    take the chunk's bytes to the next multiple of `PAD_BUCKET`, and a random tail of
    0 to `PAD_BUCKET` - 1 more. What goes over the wire is padded, not the text: the
    bytes of a JSON-escaped (or multi-byte) delta count as they are sent, and every
    chunk (a role, a tool call's piece, a finish) is padded alike. The bucket hides a
    delta's length within it, and the tail blurs the bucket's edges, so a chunk's size
    no longer says how long its token was; one read of the OS's random source a chunk
    pays for both."""
    raw = os.urandom(25)
    size = -len(chunk) % PAD_BUCKET + (raw[0] & (PAD_BUCKET - 1))
    padding = base64.urlsafe_b64encode(raw[1:])[:size].translate(_ALPHANUMERIC)
    return chunk[:-3] + b',"obfuscation":"' + padding + b'"}\n\n'


def sse(payload: Any) -> bytes:
    """One SSE event holding `payload` as JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _usage(
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int = 0,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI's usage; with the reasoning's tokens among the completion's, where there
    were any, as vLLM's server counts them with a reasoning parser. An answer's usage
    (not a chunk's running one) has `prompt_tokens_details.cached_tokens` always, 0
    where the engine said none, as OpenAI's has (vLLM's, only with
    `--enable-prompt-tokens-details`): clients price the cached share from it."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if reasoning_tokens:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


class _Template(NamedTuple):
    """A text chunk's choices, split at the index, the delta and the logprobs."""

    head: bytes  # before the index
    middle: bytes  # between the index and the delta
    after: bytes  # after the delta
    between: bytes  # with logprobs: between the delta and the logprobs
    after_logprobs: bytes  # with logprobs: after them


#: Per encoder class, its text chunk's choices around the placeholders: the same bytes
#: for every response of the class.
_TEMPLATES: dict[type, _Template] = {}


def _offsets(start: int, tokens: Sequence[TokenLogprob]) -> list[Logprob]:
    """`tokens` with where each starts, the first at `start`."""
    out = []
    for token in tokens:
        out.append((token, start))
        start += len(token.token)
    return out


class _Choice:
    """What a choice has sent so far (streams) or gathered (whole answers)."""

    __slots__ = (
        "calls",
        "ids",
        "length",
        "logprobs",
        "opened",
        "pieces",
        "prefix",
        "reason",
        "shown_prompt",
        "thoughts",
        "tokens",
    )

    def __init__(self, echo: str, prefix: bytes) -> None:
        self.prefix = prefix  # its text chunks' bytes before the delta
        self.opened = False  # streams: its opening went out
        self.tokens = 0  # streams: the tokens it has sent (continuous usage)
        self.length = len(echo)  # characters of its text so far
        self.pieces = [echo] if echo else []
        self.logprobs: list[Logprob] = []
        self.calls: dict[int, list[str]] = {}  # call index -> [id, name, arguments...]
        self.reason: FinishReason | None = None
        self.thoughts: list[str] = []  # whole answers: its reasoning's pieces
        self.ids: list[int] = []  # whole answers: its token ids (`return_token_ids`)
        self.shown_prompt = False  # streams: a chunk carried the prompt's ids


class Encoder:
    """One response's bodies; subclasses say how a choice looks.

    `choices`, `logprobs`, `tools` and `echo` (the prompt a completion's
    answer starts with) say what the request asked for; with none of them the
    answer is `plain`. `continuous_usage` (vLLM's `continuous_usage_stats`, with
    `include_usage`) puts in every chunk of a stream the usage so far of its choice:
    the prompt's tokens (the worker's `Started`) and the choice's tokens sent, its
    finish chunk counting all of them (the `Finished`). `reasoning` False leaves a
    reasoning model's reasoning out (its tokens still counted). `token_ids` (vLLM's
    `return_token_ids`) writes the prompt's and the choices' token ids."""

    id_prefix: ClassVar[str]
    object_full: ClassVar[str]
    object_chunk: ClassVar[str]
    #: Whether an echo is written with `token_ids` (vLLM's completions leave it out).
    echo_with_ids: ClassVar[bool] = True

    def __init__(
        self,
        model: str,
        include_usage: bool = False,
        *,
        choices: int = 1,
        logprobs: bool = False,
        tools: bool = False,
        echo: str | None = None,
        named_tool: bool = False,
        continuous_usage: bool = False,
        reasoning: bool = True,
        token_ids: bool = False,
    ) -> None:
        # secrets.token_hex(12) is this, through two Python frames
        self.id = f"{self.id_prefix}-{os.urandom(12).hex()}"
        # A call of the function tool_choice names ends with "stop", not "tool_calls"
        # (OpenAI's reasons, as vLLM's server gives them), where the gateway builds the
        # answer: the route passes False for an upstream that chose its own reason.
        self._named_tool = named_tool
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage and include_usage
        self._prompt_tokens = 0  # the worker's `Started` says it (continuous usage)
        self.reasoning_tokens = 0  # of the answer's tokens, its reasoning's
        self.show_reasoning = reasoning  # False: left out (its tokens still counted)
        self.logprobs = logprobs
        self.token_ids = token_ids
        self._prompt_ids: list[int] = []  # the worker's `Started` says them (`token_ids`)
        if token_ids and not self.echo_with_ids:
            echo = None
        self.echo = echo or ""
        self.plain = (
            choices == 1
            and not logprobs
            and not tools
            and echo is None
            and not self.continuous_usage
            and not token_ids
        )
        # every stream chunk's bytes up to its choices, and after them where the usage is null
        head = orjson.dumps(self._head_of(self.object_chunk))
        self._start = b"data: " + head[:-1] + b',"choices":'
        self._end = _USAGE_NULL_END if include_usage else _END
        template = self._template()
        self._head = self._start + template.head
        self._middle = template.middle
        self._after = template.after + self._end
        self._before = self._head + b"0" + self._middle  # choice 0's bytes before its delta
        self._choices: dict[int, _Choice] = {}
        if logprobs:
            self._between = template.between
            self._after_logprobs = template.after_logprobs + self._end

    def _template(self) -> _Template:
        """This class's text chunk's choices, split once."""
        template = _TEMPLATES.get(type(self))
        if template is None:
            choice = {"index": _INDEX, **self.delta_choice(_TEXT), "finish_reason": None}
            head, rest = orjson.dumps([choice]).split(_INDEX_JSON, 1)
            middle, after = rest.split(_TEXT_JSON, 1)
            # its logprobs where delta_choice puts them, else after it (the finish last)
            choice = {"index": 0, **self.delta_choice(_TEXT), "logprobs": _LOGPROBS}
            rest = orjson.dumps([{**choice, "finish_reason": None}]).split(_TEXT_JSON, 1)[1]
            between, after_logprobs = rest.split(_LOGPROBS_JSON, 1)
            template = _Template(head, middle, after, between, after_logprobs)
            _TEMPLATES[type(self)] = template
        return template

    def _head_of(self, object_: str) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model}

    def _chunk(
        self, choice: dict[str, Any], reason: FinishReason | None, index: int = 0, top: bytes = b""
    ) -> bytes:
        """A stream chunk of one choice (its bytes as `sse` would make them); `top`: more
        of the chunk's keys after its choices (`,"key":value`)."""
        choices = [{"index": index, **choice, "finish_reason": self._reason(reason)}]
        if not self.continuous_usage:
            return self._start + orjson.dumps(choices) + top + self._end
        opened = self._choices.get(index)
        usage = None if opened is None else _usage(self._prompt_tokens, opened.tokens)
        usage_json = b',"usage":' + orjson.dumps(usage)
        return self._start + orjson.dumps(choices) + top + usage_json + _END

    def _closed(self, tail: bytes, choice: _Choice) -> bytes:
        """A text chunk's `tail` (its bytes after the delta or the logprobs), with the
        choice's usage so far where that asks for it."""
        if not self.continuous_usage:
            return tail
        usage = orjson.dumps(_usage(self._prompt_tokens, choice.tokens))
        return tail[: -len(_NULL_END)] + usage + b"}\n\n"

    def _reason(self, reason: FinishReason | None) -> str | None:
        if reason is None:
            return None
        if reason is FinishReason.TOOL_CALLS and self._named_tool:
            return FinishReason.STOP.value
        return reason._value_  # what `value`, a property run in Python, reads

    # What subclasses say.

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        """A stream choice carrying `text` (None: carrying nothing)."""
        raise NotImplementedError

    def full_choice(
        self, text: str, logprobs: Any, calls: list[dict[str, Any]], reasoning: str = ""
    ) -> dict[str, Any]:
        """A whole answer's choice: its text, logprobs (JSON or None), tool calls and
        reasoning ("": none)."""
        raise NotImplementedError

    def logprobs_json(self, logprobs: Sequence[Logprob]) -> Any:
        """The `logprobs` of a choice (or of a chunk) holding these tokens."""
        raise NotImplementedError

    def open_choice(self, index: int) -> bytes:
        """What a stream sends before choice `index`'s first delta."""
        return b""

    def tool_chunk(self, event: ToolCallDelta) -> bytes:
        """A stream chunk carrying a piece of a tool call."""
        return b""

    def reasoning_chunk(self, event: Reasoning) -> bytes:
        """A stream chunk carrying a piece of reasoning (only chats have any: an
        upstream's reasoning is read from chat chunks alone)."""
        return b""

    def ids_of(
        self, choice: dict[str, Any], ids: Sequence[int] | None, index: int
    ) -> dict[str, Any]:
        """A stream chunk's or an answer's `choice` with its token ids, where the
        request asked for them (`token_ids`): those given, [] for none."""
        if self.token_ids:
            choice["token_ids"] = list(ids or ())
        return choice

    # The fast path: one choice of plain text.

    def opening(self) -> bytes:
        """What a stream sends before the first text."""
        return self.open_choice(0)

    def delta(self, text: str) -> bytes:
        """A chunk carrying `text`."""
        return self._before + orjson.dumps(text) + self._after

    def deltas(self, batch: list[Event]) -> bytes:
        """The chunks of a batch that holds reasoning, in its order: a chunk for each
        run of reasoning, one for each run of text between them."""
        out: list[bytes] = []
        texts: list[str] = []
        for event in batch:
            if type(event) is Text:
                texts.append(event.text)
            elif type(event) is Reasoning:
                self._flush(texts, out)
                out.append(self.reasoning_chunk(event))
        self._flush(texts, out)
        return b"".join(out)

    def _flush(self, texts: list[str], out: list[bytes]) -> None:
        """A run of texts as one chunk, if they hold any; the run emptied."""
        text = "".join(texts)
        if text:
            out.append(self.delta(text))
        texts.clear()

    def closing(
        self,
        reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int = 0,
    ) -> bytes:
        """The last chunk, the usage chunk if asked for, and [DONE]."""
        return self._chunk(self.delta_choice(None), reason) + self.end(
            prompt_tokens, completion_tokens, cached_tokens
        )

    def response(
        self,
        text: str,
        reason: FinishReason,
        prompt_tokens: int,
        completion_tokens: int,
        reasoning: Sequence[Reasoning] = (),
        cached_tokens: int = 0,
    ) -> bytes:
        """A whole, non-streamed answer (with its reasoning's pieces, if any)."""
        self.reasoning_tokens += sum(piece.tokens for piece in reasoning)
        full = self.full_choice(text, None, [], "".join(piece.text for piece in reasoning))
        choice = {"index": 0, **full, "finish_reason": reason._value_}
        return self._body([choice], prompt_tokens, completion_tokens, cached_tokens)

    def _body(
        self, choices: list[Any], prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> bytes:
        body = self._head_of(self.object_full)
        body["choices"] = choices
        usage = _usage(prompt_tokens, completion_tokens, self.reasoning_tokens, cached_tokens)
        body["usage"] = usage
        if self.token_ids:
            self.answer_ids(body)
        return orjson.dumps(body)

    def answer_ids(self, body: dict[str, Any]) -> None:
        """A whole answer's prompt's ids, where its kind writes them beside its choices."""

    # Every other answer: events choice by choice.

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            prefix = self._head + str(index).encode() + self._middle
            choice = self._choices[index] = _Choice(self.echo, prefix)
        return choice

    def events(self, batch: list[Event]) -> bytes:
        """The SSE chunks of a batch of events, of any choices: a choice's
        opening before its first chunk, one chunk per run of its text, one per
        piece of a tool call, a finish chunk per `Finished`."""
        out = []
        run: list[Text] = []
        for event in batch:
            if type(event) is Started:
                self._prompt_tokens = event.prompt_tokens
                self._prompt_ids = list(event.prompt_token_ids or ())
                continue
            if isinstance(event, Text):
                if run and run[0].index != event.index:
                    out.append(self._text_chunk(run))
                    run = []
                run.append(event)
                continue
            if run:
                out.append(self._text_chunk(run))
                run = []
            if isinstance(event, ToolCallDelta):
                opening = self._opened(event.index)
                self._choices[event.index].tokens += event.tokens
                out.append(opening + self.tool_chunk(event))
            elif isinstance(event, Reasoning):
                opening = self._opened(event.index)
                self._choices[event.index].tokens += event.tokens
                out.append(opening + self.reasoning_chunk(event))
            elif isinstance(event, Finished):
                opening = self._opened(event.index)
                choice = self._choices[event.index]
                choice.tokens = max(choice.tokens, event.completion_tokens)
                ended = self.ids_of(self.delta_choice(None), event.token_ids, event.index)
                finish = self._chunk(ended, event.reason, event.index)
                out.append(opening + finish)
        if run:
            out.append(self._text_chunk(run))
        return b"".join(out)

    def _opened(self, index: int) -> bytes:
        """Choice `index`'s opening if it has not gone out yet."""
        choice = self._choice(index)
        if choice.opened:
            return b""
        choice.opened = True
        return self.open_choice(index)

    def _text_chunk(self, run: list[Text]) -> bytes:
        """One chunk for a run of a choice's text; none for a run of nothing
        (a worker's empty Text carries logprobs, if anything)."""
        index = run[0].index
        opening = self._opened(index)
        choice = self._choices[index]
        if self.continuous_usage:  # the count only its usage reads
            choice.tokens += sum(t.tokens for t in run)
        text = run[0].text if len(run) == 1 else "".join(t.text for t in run)
        if self.token_ids:
            return opening + self._ids_text_chunk(choice, run, text)
        if not self.logprobs:
            if not text:
                return opening
            choice.length += len(text)
            return opening + choice.prefix + orjson.dumps(text) + self._closed(self._after, choice)
        logprobs = self._logprobs_of(choice, run)
        if not text and not logprobs:
            return opening
        return (
            opening
            + choice.prefix
            + orjson.dumps(text)
            + self._between
            + orjson.dumps(self.logprobs_json(logprobs))
            + self._closed(self._after_logprobs, choice)
        )

    def _ids_text_chunk(self, choice: _Choice, run: list[Text], text: str) -> bytes:
        """`_text_chunk`'s chunk with the run's token ids, built as a dict (unpadded:
        an obfuscating encoder pads it as any text chunk); one of empty text is written
        where it carries ids (a stop string's, cut from the text), as vLLM writes it."""
        if self.logprobs:
            logprobs = self._logprobs_of(choice, run)
        else:
            logprobs = []
            choice.length += len(text)
        ids = [i for t in run if t.token_ids for i in t.token_ids]
        if not text and not logprobs and not ids:
            return b""
        body = self.delta_choice(text)
        if self.logprobs:
            body["logprobs"] = self.logprobs_json(logprobs)
        index = run[0].index
        return Encoder._chunk(self, self.ids_of(body, ids, index), None, index)

    @staticmethod
    def _logprobs_of(choice: _Choice, texts: Sequence[Text]) -> list[Logprob]:
        """The logprobs `texts` carry, placed in `choice`'s text; counts their text."""
        logprobs: list[Logprob] = []
        for text in texts:
            if text.logprobs:
                logprobs += _offsets(choice.length, text.logprobs)
            choice.length += len(text.text)
        return logprobs

    def failure(self, error: APIError) -> bytes:
        """What a stream sends when it fails after its head: one error payload, [DONE]."""
        return sse({"error": error.fields()}) + DONE

    def end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The usage chunk if asked for (tokens summed over the choices), and [DONE]."""
        if not self.include_usage:
            return DONE
        usage = _usage(prompt_tokens, completion_tokens, self.reasoning_tokens, cached_tokens)
        return self._start + b'[],"usage":' + orjson.dumps(usage) + _END + DONE

    def add(self, batch: list[Event]) -> None:
        """Gathers a batch of events, of any choices, for `answer`."""
        for event in batch:
            if self.token_ids:
                self._add_ids(event)
            if isinstance(event, Text):
                choice = self._choice(event.index)
                choice.pieces.append(event.text)
                if self.logprobs:
                    choice.logprobs += self._logprobs_of(choice, (event,))
            elif isinstance(event, ToolCallDelta):
                calls = self._choice(event.index).calls
                call = calls.get(event.call_index)
                if call is None:
                    calls[event.call_index] = [event.id, event.name, event.arguments]
                else:
                    call.append(event.arguments)
            elif isinstance(event, Reasoning):
                self._choice(event.index).thoughts.append(event.text)
                self.reasoning_tokens += event.tokens
            elif isinstance(event, Finished):
                self._choice(event.index).reason = event.reason

    def _add_ids(self, event: Event) -> None:
        """Gathers an event's token ids (`token_ids`): the prompt's, or its choice's."""
        if isinstance(event, Started):
            self._prompt_ids = list(event.prompt_token_ids or ())
        elif event.token_ids:
            self._choice(event.index).ids += event.token_ids

    def answer(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        """The whole answer from what `add` gathered, choices by index."""
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            calls = [
                {
                    "id": call[0],
                    "type": "function",
                    "function": {"name": call[1], "arguments": "".join(call[2:])},
                }
                for _, call in sorted(choice.calls.items())
            ]
            logprobs = self.logprobs_json(choice.logprobs) if self.logprobs else None
            reasoning = "".join(choice.thoughts)
            full = self.full_choice("".join(choice.pieces), logprobs, calls, reasoning)
            full = {"index": index, **full, "finish_reason": self._reason(choice.reason)}
            choices.append(self.ids_of(full, choice.ids, index))
        return self._body(choices, prompt_tokens, completion_tokens, cached_tokens)


def token_bytes(token: str) -> list[int]:
    """A token's UTF-8 bytes, as OpenAI's logprobs show them (`bytes`)."""
    return list(token.encode())


class ChatEncoder(Encoder):
    """/v1/chat/completions."""

    id_prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        return {"delta": {} if text is None else {"content": text}, "logprobs": None}

    def full_choice(
        self, text: str, logprobs: Any, calls: list[dict[str, Any]], reasoning: str = ""
    ) -> dict[str, Any]:
        reasoning = reasoning if self.show_reasoning else ""
        # no text: null beside calls or reasoning, as vLLM's server says it
        content = text or (None if calls or reasoning else "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:  # vLLM's field (formerly `reasoning_content`)
            message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "logprobs": logprobs}

    def logprobs_json(self, logprobs: Sequence[Logprob]) -> Any:
        return {
            "content": [
                {
                    "token": token.token,
                    "logprob": max(token.logprob, MIN_LOGPROB),
                    "bytes": token_bytes(token.token),
                    "top_logprobs": [
                        {"token": t, "logprob": max(lp, MIN_LOGPROB), "bytes": token_bytes(t)}
                        for t, lp in token.top
                    ],
                }
                for token, _ in logprobs
            ]
        }

    def ids_of(
        self, choice: dict[str, Any], ids: Sequence[int] | None, index: int
    ) -> dict[str, Any]:
        """A chat's choices' ids are null where its reasoning is left out
        (`include_reasoning` false): they would show the reasoning's tokens, as vLLM's
        server hides them."""
        if self.token_ids:
            choice["token_ids"] = list(ids or ()) if self.show_reasoning else None
        return choice

    def answer_ids(self, body: dict[str, Any]) -> None:
        """The prompt's ids at the answer's top level."""
        body["prompt_token_ids"] = self._prompt_ids

    def open_choice(self, index: int) -> bytes:
        """Chat streams open each choice with the assistant's role and empty content
        (with `token_ids`, the prompt's ids at the chunk's top level), then the echoed
        message (vLLM's chat `echo`) in a chunk of its own, as vLLM's."""
        delta = {"role": "assistant", "content": ""}
        top = b',"prompt_token_ids":' + orjson.dumps(self._prompt_ids) if self.token_ids else b""
        opening = self._chunk({"delta": delta, "logprobs": None}, None, index, top)
        if not self.echo:
            return opening
        return opening + self._chunk(self.delta_choice(self.echo), None, index)

    def tool_chunk(self, event: ToolCallDelta) -> bytes:
        """The first piece of a call has its id, type and name; the next ones
        only more of its arguments."""
        call: dict[str, Any] = {"index": event.call_index}
        if event.id or event.name:
            call["id"] = event.id
            call["type"] = "function"
            call["function"] = {"name": event.name, "arguments": event.arguments}
        else:
            call["function"] = {"arguments": event.arguments}
        choice = {"delta": {"tool_calls": [call]}, "logprobs": None}
        return self._chunk(self.ids_of(choice, event.token_ids, event.index), None, event.index)

    def reasoning_chunk(self, event: Reasoning) -> bytes:
        """vLLM's: the piece in the delta's `reasoning`."""
        self.reasoning_tokens += event.tokens
        if not self.show_reasoning or not (event.text or (self.token_ids and event.token_ids)):
            return b""
        choice = {"delta": {"reasoning": event.text}, "logprobs": None}
        return self._chunk(self.ids_of(choice, event.token_ids, event.index), None, event.index)


class CompletionEncoder(Encoder):
    """/v1/completions (no tool calls: the route refuses tools there)."""

    id_prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"
    echo_with_ids = False  # vLLM's server writes the prompt's ids instead

    def ids_of(
        self, choice: dict[str, Any], ids: Sequence[int] | None, index: int
    ) -> dict[str, Any]:
        """A completion's prompt's ids are in its choice: a whole answer's each, a
        stream's first chunk of each."""
        if self.token_ids:
            opened = self._choice(index)
            if not opened.shown_prompt:
                opened.shown_prompt = True
                choice["prompt_token_ids"] = self._prompt_ids
            choice["token_ids"] = list(ids or ())
        return choice

    def delta_choice(self, text: str | None) -> dict[str, Any]:
        return {"text": text or "", "logprobs": None}

    def full_choice(
        self, text: str, logprobs: Any, calls: list[dict[str, Any]], reasoning: str = ""
    ) -> dict[str, Any]:
        return {"text": text, "logprobs": logprobs}

    def logprobs_json(self, logprobs: Sequence[Logprob]) -> Any:
        """The legacy shape: the alternatives of each token include the token."""
        top = []
        for token, _ in logprobs:
            alternatives = {t: max(lp, MIN_LOGPROB) for t, lp in token.top}
            alternatives.setdefault(token.token, max(token.logprob, MIN_LOGPROB))
            top.append(alternatives)
        return {
            "tokens": [token.token for token, _ in logprobs],
            "token_logprobs": [max(token.logprob, MIN_LOGPROB) for token, _ in logprobs],
            "top_logprobs": top,
            "text_offset": [offset for _, offset in logprobs],
        }

    def open_choice(self, index: int) -> bytes:
        """An echoed prompt is each choice's first delta."""
        if not self.echo:
            return b""
        return self._chunk(self.delta_choice(self.echo), None, index)


class _Obfuscating(Encoder):
    """An encoder whose every stream chunk is `obfuscated` (OpenAI's
    `stream_options.include_obfuscation`, which pads every chunk of a chat's stream, the
    role's and the finish's and the usage's too): a class of its own, chosen once per
    request, so a stream that does not ask for it runs none of it. A chunk is made by
    `delta` (the one-choice path's text), `_chunk` (a choice's opening, a tool call's or
    a reasoning's piece, a finish), `_text_chunk` (the events path's text) or `end` (the
    usage chunk); each pads what it makes."""

    def delta(self, text: str) -> bytes:
        return obfuscated(super().delta(text))

    def _chunk(
        self, choice: dict[str, Any], reason: FinishReason | None, index: int = 0, top: bytes = b""
    ) -> bytes:
        return obfuscated(super()._chunk(choice, reason, index, top))

    def _text_chunk(self, run: list[Text]) -> bytes:
        opening = self._opened(run[0].index)  # padded by `_chunk`; the base's is then b""
        chunk = super()._text_chunk(run)
        return opening + obfuscated(chunk) if chunk else opening

    def end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        if not self.include_usage:
            return DONE
        usage = super().end(prompt_tokens, completion_tokens, cached_tokens)[: -len(DONE)]
        return obfuscated(usage) + DONE


class ObfuscatedChatEncoder(_Obfuscating, ChatEncoder):
    """/v1/chat/completions, every chunk padded."""


class ObfuscatedCompletionEncoder(_Obfuscating, CompletionEncoder):
    """/v1/completions, every chunk padded: OpenAI's completions take the same
    `stream_options` as its chats."""


#: An encoder's class whose chunks are padded, for a stream that asks for it.
OBFUSCATED: dict[type[Encoder], type[Encoder]] = {
    ChatEncoder: ObfuscatedChatEncoder,
    CompletionEncoder: ObfuscatedCompletionEncoder,
}
