"""OpenAI-compatible HTTP servers as workers: vLLM, SGLang, TGI's OpenAI API, or
another furnace-gateway, behind the same fleet as gRPC workers.

Our request becomes their `/chat/completions` or `/completions` call with
`stream: true` and usage included; their server-sent events become our events;
their errors map into our error tree (`HTTP_ERRORS`), so the edge answers them
as it answers a gRPC worker's. Upstreams share one pooled `httpx.AsyncClient`
(one per private CA, `ca_file`), and plain http:// ones stream over their own
connections (below); a model's `api_key_env` key goes as
`Authorization: Bearer` on each of its calls, and only there (never in a log or
an error). A client that leaves closes the upstream stream.

Every field of our request goes into their body as OpenAI and vLLM name it
(`request_body`: messages and tools in `gateway.protocol.chat`'s shapes,
tool_choice, response_format, logprobs, n, user, and vLLM's extra sampling
fields); `describe` says they serve every feature, so what a server cannot do
it refuses itself, and its 400 naming the parameter reaches the client as
one. Their chunks become our events choice by choice: content (with logprobs)
as `Text`, `delta.tool_calls` as `ToolCallDelta`, each choice's finish reason
as its `Finished`; `embed` is their `/embeddings`.

Their stream has no `Started` with the prompt's size: `Started(0)` goes out
with their first event (so an error event in its place is still a refusal),
and the prompt tokens ride on `Finished` from their usage chunk.

Cost: streamed completions to a plain http:// upstream (the in-cluster case)
go over the upstream's own kept-alive connections (`_Pool`, `_Connection`, an
asyncio protocol over httptools): httpx's stack (httpcore, h11, three async
generators) cost tens of microseconds per SSE event, as every event is its own
HTTP chunk. Here a network read of many events is one callback: httptools undoes
the chunking in C, `_Stream` cuts the `data:` lines with one `split`, parses each
once with orjson, and queues the events, merging a choice's pieces that arrived
together, so the reader gets fewer, larger events and one wake-up per read; a
reader that falls behind pauses the socket. https, a proxy from the environment,
embeddings, /models and /health go through the fleet's httpx client (TLS and its
CA, proxies). Measured against a fast fake engine, 32 streams on 2 loaded cores:
tokens/s through the gateway went from about 0.45 to 0.85 of direct, the added
TTFT at 1 stream from about 1.45 ms to 0.45 ms.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from itertools import zip_longest
from typing import Any, cast
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import httptools
import httpx
import orjson

from gateway.protocol import errors, features
from gateway.protocol.chat import message_dict, tool_dict
from gateway.protocol.types import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    ResponseFormat,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.upstreams.base import (
    CANCELLED,
    CallEnd,
    ModelDescription,
    StreamBookkeeping,
    UpstreamCall,
)

#: Their HTTP status → our error; 400s are refined by the error body's code.
HTTP_ERRORS: dict[int, type[errors.EngineError]] = {
    400: errors.Invalid,
    401: errors.AuthFailed,
    403: errors.AuthFailed,
    404: errors.ModelNotFound,
    408: errors.Timeout,
    413: errors.Invalid,
    422: errors.Invalid,
    429: errors.Busy,
    502: errors.Unavailable,
    503: errors.Unavailable,
    504: errors.Timeout,
}
#: Codes in their error bodies that name one of our errors.
ERROR_CODES: dict[str, type[errors.EngineError]] = {
    "context_length_exceeded": errors.TooLong,
    "model_not_found": errors.ModelNotFound,
    "server_busy": errors.Busy,
    "engine_unavailable": errors.Unavailable,
    "timeout": errors.Timeout,
    "engine_auth_failed": errors.AuthFailed,
}
#: Servers that give no such code (vLLM answers `"code": 400`): what their message or
#: `param` says. vLLM: "This model's maximum context length is 1024 tokens. However,
#: your prompt contains at least 1025 input tokens ...", `"param": "input_tokens"`.
TOO_LONG_MESSAGES = ("maximum context length",)
TOO_LONG_PARAMS = ("input_tokens",)
_REASONS = {r.value: r for r in FinishReason}
#: Finish reasons that are failures (vLLM's, as its gRPC server's in `vllm_grpc`).
_FINISH_ERRORS: dict[str, type[errors.EngineError]] = {
    "abort": errors.Unavailable,  # aborted by the engine (shutdown, preemption)
    "error": errors.Failed,
}
#: The largest SSE line (one event) and error body read from an upstream: past them the
#: upstream is failing, and reading on would only grow the gateway's memory.
MAX_EVENT_BYTES = 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
#: An embeddings answer may take this much per input (~10k floats as JSON text), plus
#: the error bound for the rest.
MAX_EMBEDDING_BYTES = 256 * 1024
_TOO_LARGE = "The upstream sent an event larger than the gateway takes."
#: Pieces of a choice that arrive together are merged up to this many characters, and
#: reading pauses while more than `_PAUSE_AT` events wait: a reader that falls behind
#: holds at most about 1 MiB of a stream.
_MERGE_CHARS = 16 * 1024
_PAUSE_AT = 64
#: Idle kept-alive connections an upstream keeps (as the fleet's httpx client does).
_MAX_IDLE = 256
_CLOSING: set[asyncio.Task[None]] = set()
_BREAKS_HEADER = re.compile(r"[\r\n\x00]")  # upstream responses being closed after a cancel


def _error_fields(payload: Any) -> dict[str, Any]:
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(payload, dict) and payload.get("object") == "error":  # vLLM's older shape
        return payload
    return {}


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """At most `limit` bytes of a streamed response's body."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def error_from_response(status: int, body: bytes) -> errors.EngineError:
    """Our error for an upstream's error response."""
    try:
        fields = _error_fields(orjson.loads(body))
    except orjson.JSONDecodeError:
        fields = {}
    return _error(status, fields, f"upstream answered HTTP {status}")


def error_from_event(payload: dict[str, Any]) -> errors.EngineError:
    """Our error for an error event in their stream. vLLM refuses some parameters
    only once streaming (e.g. an out-of-vocabulary `logit_bias` id): its event
    then has the HTTP status as its `code` and names the `param`, and reads as
    that response would."""
    fields = _error_fields(payload)
    code = fields.get("code")
    status = code if type(code) is int and code in HTTP_ERRORS else None
    return _error(status, fields, "upstream stream failed")


def _error(status: int | None, fields: dict[str, Any], default: str) -> errors.EngineError:
    """The one table: their error body's code, else its status (`HTTP_ERRORS`),
    with vLLM's wording of a prompt beyond the context; no status: a failure."""
    message = str(fields.get("message") or default)
    error_type = ERROR_CODES.get(str(fields.get("code")))
    param = fields.get("param")
    if error_type is None and status == 400 and _too_long(message, param):
        return errors.TooLong(message)
    if error_type is None:
        if status is None:
            error_type = errors.Failed
        else:
            error_type = HTTP_ERRORS.get(status, errors.Failed if status >= 500 else errors.Invalid)
    return error_type(message, param=param if isinstance(param, str) else None)


def _too_long(message: str, param: Any) -> bool:
    """Whether a 400 without our code is a prompt beyond the context, as vLLM words it."""
    return param in TOO_LONG_PARAMS or any(m in message for m in TOO_LONG_MESSAGES)


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """Our request as an OpenAI body, streamed with usage: every field the way
    OpenAI and vLLM take it (vLLM's extra sampling fields by vLLM's names)."""
    s = request.sampling
    chat = request.messages is not None
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.messages is not None:
        body["messages"] = [message_dict(m) for m in request.messages]
    else:
        body["prompt"] = request.prompt or ""
    for name in _SAMPLING:
        value = getattr(s, name)
        if value is not None:
            body[name] = value
    if s.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.n != 1:
        body["n"] = request.n
    if request.logprobs is not None:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = request.logprobs
        else:
            body["logprobs"] = request.logprobs
    if request.tools:
        body["tools"] = [tool_dict(t) for t in request.tools]
    if request.tool_choice:
        choice = request.tool_choice
        body["tool_choice"] = (
            choice
            if choice in _TOOL_CHOICES
            else {"type": "function", "function": {"name": choice}}
        )
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.response_format is not None:
        body["response_format"] = _response_format(request.response_format)
    if request.user:
        body["user"] = request.user
    return body


#: Sampling fields sent as they are, when set (OpenAI's, then vLLM's extra ones).
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "min_p",
)
_TOOL_CHOICES = frozenset({"none", "auto", "required"})


def _response_format(format: ResponseFormat) -> dict[str, Any]:
    if format.type != "json_schema":
        return {"type": format.type}
    schema: dict[str, Any] = {"name": format.name}
    if format.schema:
        schema["schema"] = orjson.loads(format.schema)
    if format.strict:
        schema["strict"] = True
    return {"type": "json_schema", "json_schema": schema}


def _chat_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """A chat choice's `logprobs.content`: one entry per token, alternatives in the
    server's order."""
    content = logprobs.get("content") if type(logprobs) is dict else None
    if not content:
        return None
    return tuple(
        TokenLogprob(
            entry["token"],
            entry["logprob"],
            tuple((alt["token"], alt["logprob"]) for alt in entry.get("top_logprobs") or ()),
        )
        for entry in content
    )


def _completion_logprobs(logprobs: Any) -> tuple[TokenLogprob, ...] | None:
    """A completion choice's logprobs: parallel lists of tokens, their logprobs and
    {token: logprob} alternatives."""
    tokens = logprobs.get("tokens") if type(logprobs) is dict else None
    if not tokens:
        return None
    tops = logprobs.get("top_logprobs") or ()
    return tuple(
        TokenLogprob(token, value, tuple((top or {}).items()))
        for token, value, top in zip_longest(tokens, logprobs.get("token_logprobs") or (), tops)
    )


class _Stream:
    """Reads their event stream, as our events: bytes in large reads are cut into
    `data:` lines in one pass, each parsed once, and the events appended to
    `ready`. Text and tool-call pieces of one choice that arrive in one read are
    merged into one event (the edge then writes one chunk for them).

    Tokens: a piece counts one token (vLLM sends one per chunk), or one per
    logprob when it has them. A call of n choices ends with n `Finished`, given
    out at `[DONE]`, when their usage is known: each choice has its own count
    where the server sent per-chunk usage (vLLM's `continuous_usage_stats`);
    else the total of the usage chunk goes on the last choice to finish and 0
    on the others; with no usage at all, each has the pieces counted. Every
    `Finished` carries the prompt's tokens (the same number, not a share).
    """

    __slots__ = (
        "_chat",
        "_counted",
        "_n",
        "_parts",
        "_prompt_tokens",
        "_reasons",
        "_size",
        "_total",
        "_usages",
        "done",
        "ready",
    )

    def __init__(self, chat: bool, n: int) -> None:
        self._chat = chat
        self._n = n
        self.ready: deque[Event] = deque()
        self.done = False
        self._parts: list[bytes] = []  # an unfinished line, in the pieces it came in
        self._size = 0
        self._counted = [0] * n  # pieces' tokens per choice
        self._usages: dict[int, int] = {}  # per-chunk usage's completion tokens per choice
        self._reasons: dict[int, FinishReason] = {}  # in the order the choices finished
        self._prompt_tokens: int | None = None
        self._total: int | None = None

    def feed(self, data: bytes) -> None:
        """Parses the complete lines of `data` (and of what came before it)."""
        if b"\n" not in data:
            self._parts.append(data)
            self._size += len(data)
            if self._size > MAX_EVENT_BYTES:
                raise errors.Failed(_TOO_LARGE)
            return
        if self._parts:
            self._parts.append(data)
            data = b"".join(self._parts)
            self._parts.clear()
        lines = data.split(b"\n")
        rest = lines.pop()
        if rest:
            self._parts.append(rest)
        self._size = len(rest)
        for line in lines:
            if line[:5] != b"data:":
                continue  # comments (keep-alives), event names, blank separators
            if len(line) > MAX_EVENT_BYTES:
                raise errors.Failed(_TOO_LARGE)
            if len(line) < 16 and line[5:].strip() == b"[DONE]":
                self._end()
                return
            try:
                payload = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                raise errors.Failed("The upstream sent an event that is not JSON.") from None
            if type(payload) is not dict:
                raise errors.Failed("The upstream sent an event that is not an object.")
            try:
                self._chunk(payload)
            except (AttributeError, KeyError, TypeError, ValueError):
                raise errors.Failed("The upstream sent an event of an unknown shape.") from None
        if self._size > MAX_EVENT_BYTES:
            raise errors.Failed(_TOO_LARGE)

    def _chunk(self, payload: dict[str, Any]) -> None:
        if "error" in payload or payload.get("object") == "error":
            raise error_from_event(payload)
        choices = payload.get("choices")
        usage = payload.get("usage")
        if type(usage) is dict:
            self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
            if not choices:
                self._total = usage.get("completion_tokens", self._total)
            elif len(choices) == 1 and "completion_tokens" in usage:  # per-chunk usage
                self._usages[choices[0].get("index") or 0] = usage["completion_tokens"]
        if not choices:
            return
        for choice in choices:
            self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index") or 0
        if not 0 <= index < self._n:
            raise errors.Failed(f"The upstream sent choice {index} of {self._n}.")
        if self._chat:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            calls = delta.get("tool_calls")
            logprobs = _chat_logprobs(choice["logprobs"]) if choice.get("logprobs") else None
        else:
            text = choice.get("text")
            calls = None
            logprobs = _completion_logprobs(choice["logprobs"]) if choice.get("logprobs") else None
        tokens = 1 if logprobs is None else len(logprobs)
        if text or logprobs:
            self._text(Text(text or "", tokens, index, logprobs))
            self._counted[index] += tokens
            tokens = 0
        if calls:
            for call in calls:
                self._tool_call(index, call, tokens)
                self._counted[index] += tokens
                tokens = 0
        reason = choice.get("finish_reason")
        if reason is not None and index not in self._reasons:
            failure = _FINISH_ERRORS.get(reason)
            if failure is not None:
                raise failure(f"The upstream ended choice {index} with `{reason}`.")
            self._reasons[index] = _REASONS.get(reason, FinishReason.STOP)

    def _text(self, text: Text) -> None:
        ready = self.ready
        if ready:
            last = ready[-1]
            if type(last) is Text and last.index == text.index and len(last.text) < _MERGE_CHARS:
                if last.logprobs is None and text.logprobs is None:
                    ready[-1] = Text(last.text + text.text, last.tokens + text.tokens, text.index)
                    return
                if last.logprobs is not None and text.logprobs is not None:
                    logprobs = last.logprobs + text.logprobs
                    merged = last.text + text.text
                    ready[-1] = Text(merged, last.tokens + text.tokens, text.index, logprobs)
                    return
        ready.append(text)

    def _tool_call(self, index: int, call: dict[str, Any], tokens: int) -> None:
        function = call.get("function") or {}
        call_index = call.get("index") or 0
        call_id = call.get("id") or ""
        name = function.get("name") or ""
        arguments = function.get("arguments") or ""
        if not call_id and not name and not arguments:
            return  # an empty piece (its token is counted on the choice)
        ready = self.ready
        if ready and not call_id and not name:
            last = ready[-1]
            if (
                type(last) is ToolCallDelta
                and (last.index, last.call_index) == (index, call_index)
                and len(last.arguments) < _MERGE_CHARS
            ):
                ready[-1] = last._replace(
                    arguments=last.arguments + arguments, tokens=last.tokens + tokens
                )
                return
        ready.append(ToolCallDelta(index, call_index, call_id, name, arguments, tokens))

    def _end(self) -> None:
        """`[DONE]`: every choice's `Finished`, its tokens divided as the class says."""
        self.done = True
        order = [*self._reasons, *(i for i in range(self._n) if i not in self._reasons)]
        counts = {i: self._usages.get(i, self._counted[i]) for i in order}
        unknown = [i for i in order if i not in self._usages]
        if self._total is not None and unknown:
            for i in unknown:
                counts[i] = 0
            known = sum(self._usages.values())
            counts[unknown[-1]] = max(0, self._total - known)
        for i in order:
            reason = self._reasons.get(i, FinishReason.STOP)
            self.ready.append(Finished(reason, counts[i], self._prompt_tokens, i))


class OpenAIHttpCall(StreamBookkeeping):
    """One streamed call over the fleet's httpx client (https upstreams, or a
    proxy from the environment), read as our events; `timeout` bounds each read."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        request: httpx.Request,
        stream: _Stream,
        worker: str,
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(worker, on_close)
        self._http = http
        self._request = request
        self._stream = stream
        self._ready = stream.ready
        self._response: httpx.Response | None = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._failure: errors.EngineError | None = None  # found after events still to give

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._ready:
            return self._ready.popleft()
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._response is None:
                return await self._open()
            await self._read()
            return self._ready.popleft()
        except errors.EngineError as error:
            await self._finish(error)
            raise
        except httpx.TimeoutException as error:
            failure: errors.EngineError = errors.Timeout(f"upstream timed out: {error}")
        except httpx.TransportError as error:
            failure = errors.Unavailable(f"upstream unreachable: {error}")
        await self._finish(failure)
        raise failure

    async def _open(self) -> Event:
        response = await self._http.send(self._request, stream=True)
        self._response = response
        if response.status_code != 200:
            body = await read_capped(response, MAX_ERROR_BYTES)
            raise error_from_response(response.status_code, body)
        self._chunks = response.aiter_bytes()
        # Started waits for their first event: a refusal they stream (vLLM's 400s
        # found after its headers) is then still a refusal, answered as its status.
        await self._read()
        return Started(0)

    async def _read(self) -> None:
        """Reads until it has events (or the stream's end, or a failure)."""
        assert self._chunks is not None
        stream = self._stream
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            try:
                data = await anext(self._chunks)
            except StopAsyncIteration:
                raise errors.Failed("The upstream ended its stream without [DONE].") from None
            try:
                stream.feed(data)
            except errors.EngineError as error:
                self._failure = error  # the events before it go out first
            if stream.done:
                await self._finish(None)
                return

    async def _finish(self, outcome: CallEnd) -> None:
        if self._response is not None:
            await self._response.aclose()
        self.close(outcome)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Closes the upstream connection (the upstream sees the client leave)."""
        self._ready.clear()
        if self._response is not None:
            closing = asyncio.get_running_loop().create_task(self._response.aclose())
            _CLOSING.add(closing)  # the loop keeps only a weak reference to a task
            closing.add_done_callback(_CLOSING.discard)
        self.close(outcome)


def _embed_error(status: int, body: bytes) -> errors.EngineError:
    """Our error for a refused embedding: a 404 that is not an OpenAI error (vLLM
    serving a generative model has no such route) says the model embeds nothing."""
    if status == 404:
        try:
            fields = _error_fields(orjson.loads(body))
        except orjson.JSONDecodeError:
            fields = {}
        if not fields:
            return errors.Invalid("The model's upstream serves no embeddings.", param="model")
    return error_from_response(status, body)


def embeddings_from(content: bytes, request: EmbedRequest) -> Embeddings:
    """Their embeddings answer: one vector of numbers per input, all of one width
    (`dimensions` when asked), placed by their `index`."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise errors.Failed("The upstream's embeddings answer is not JSON.") from None
    data = payload.get("data") if type(payload) is dict else None
    count = len(request.inputs)
    if type(data) is not list or len(data) != count:
        got = len(data) if type(data) is list else "no"
        raise errors.Failed(f"The upstream gave {got} embeddings for {count} inputs.")
    vectors: list[tuple[float, ...] | None] = [None] * count
    for position, item in enumerate(data):
        index = item.get("index", position) if type(item) is dict else None
        vector = item.get("embedding") if type(item) is dict else None
        if (
            type(index) is not int
            or not 0 <= index < count
            or vectors[index] is not None
            or type(vector) is not list
            or not all(type(x) is float or type(x) is int for x in vector)
        ):
            raise errors.Failed(f"The upstream's embedding {position} is not a vector of numbers.")
        vectors[index] = tuple(vector)
    widths = {len(v) for v in vectors if v is not None}
    if len(widths) != 1 or (request.dimensions is not None and widths != {request.dimensions}):
        raise errors.Failed(f"The upstream's embeddings have widths {sorted(widths)}.")
    usage = payload.get("usage")
    tokens = usage.get("prompt_tokens") if type(usage) is dict else None
    return Embeddings(
        tuple(v for v in vectors if v is not None), tokens if type(tokens) is int else 0
    )


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection to a plain-HTTP upstream, one request
    at a time. httptools undoes the chunked encoding inside the transport's
    callback and hands the body to the call reading it (`_RawCall`): a network
    read of many SSE events is one `data_received`, one `_Stream.feed`, one
    wake-up."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.call: _RawCall | None = None
        self.reusable = False  # its last response ended whole, with keep-alive

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        call = self.call
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            if call is not None:
                call.flush()  # what came before it goes out first
                call.fail(errors.Failed(f"The upstream sent bad HTTP: {error}"))
            else:
                self.abort()  # bytes on an idle connection: it is not usable
        if call is not None:
            call.wake()

    def on_headers_complete(self) -> None:
        if self.call is not None:
            self.call.head(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.call is not None:
            self.call.body(body)

    def on_message_complete(self) -> None:
        call, self.call = self.call, None
        self.reusable = self._parser.should_keep_alive()
        if call is not None:
            call.complete(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._pool.forget(self)
        call, self.call = self.call, None
        if call is not None:
            call.fail(errors.Unavailable(f"upstream closed the connection: {exc}"))
            call.wake()

    def abort(self) -> None:
        """Drops the connection: the upstream sees its client leave."""
        self.reusable = False
        self.call = None
        if self.transport is not None:
            self.transport.abort()


class _Pool:
    """An upstream's idle kept-alive connections; a request takes one or opens one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.closed = False

    async def take(self, connect_timeout: float) -> _Connection:
        while self.idle:
            connection = self.idle.pop()
            transport = connection.transport
            if connection.reusable and transport is not None and not transport.is_closing():
                connection.reusable = False
                return connection
            self.drop(connection)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"upstream unreachable: {error!r}") from None
        self.open.add(connection)
        return connection

    def give_back(self, connection: _Connection) -> None:
        """A connection whose response ended: kept for the next request if it can
        be (up to `_MAX_IDLE` of them)."""
        if connection.reusable and not self.closed and len(self.idle) < _MAX_IDLE:
            self.idle.append(connection)
        else:
            self.drop(connection)

    def drop(self, connection: _Connection) -> None:
        connection.abort()
        self.open.discard(connection)

    def forget(self, connection: _Connection) -> None:
        """A connection the upstream (or we) closed."""
        self.open.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        """Drops every connection, idle or not."""
        self.closed = True
        for connection in self.open:
            connection.abort()
        self.open.clear()
        self.idle.clear()


class _RawCall(StreamBookkeeping):
    """One streamed call over a pooled connection (`_Connection`): the request is
    written whole; the response's body goes to `_Stream` as it arrives, and
    `__anext__` hands on what it made. Reading pauses while more than
    `_PAUSE_AT` events wait for the reader. `timeout` is the call's deadline."""

    def __init__(
        self,
        pool: _Pool,
        request: bytes,
        stream: _Stream,
        timeout: float,
        worker: str,
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(worker, on_close)
        self._pool = pool
        self._request = request
        self._stream = stream
        self._ready = stream.ready
        self._timeout = timeout
        self._connection: _Connection | None = None
        self._status = 0
        self._pieces: list[bytes] = []  # the body pieces of the read in progress
        self._error_body: list[bytes] = []
        self._error_size = 0
        self._failure: errors.EngineError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._paused = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        ready = self._ready
        if ready:
            if self._paused and len(ready) <= 1:
                self._paused = False
                connection = self._connection
                if connection is not None and connection.transport is not None:
                    connection.transport.resume_reading()
            return ready.popleft()
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._connection is None:
                await self._open()
                return Started(0)
            await self._wait()
            return ready.popleft()
        except errors.EngineError as error:
            self._end(error)
            raise

    async def _open(self) -> None:
        """Sends the request; returns at their first event (a refusal raises)."""
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._timeout, self._expire)
        connection = await self._pool.take(min(self._timeout, 5.0))
        if self._closed:  # cancelled while connecting
            self._pool.drop(connection)
            raise errors.Unavailable("The call was cancelled.")
        self._connection = connection
        connection.call = self
        assert connection.transport is not None
        connection.transport.write(self._request)
        await self._wait()

    async def _wait(self) -> None:
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            if self._stream.done:
                return
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    # -- the connection's callbacks -------------------------------------------------

    def wake(self) -> None:
        """After a read: what it brought is parsed, the reader goes on, and too
        much waiting pauses reading."""
        self.flush()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if len(self._ready) > _PAUSE_AT and not self._paused:
            connection = self._connection
            if connection is not None and connection.transport is not None:
                self._paused = True
                connection.transport.pause_reading()

    def head(self, status: int) -> None:
        self._status = status

    def body(self, data: bytes) -> None:
        self._pieces.append(data)  # parsed once per read, in `flush`

    def flush(self) -> None:
        """Parses the body pieces of the last read as one."""
        pieces = self._pieces
        if not pieces:
            return
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if self._failure is not None or self._stream.done:
            return
        if self._status != 200:
            if self._error_size < MAX_ERROR_BYTES:
                self._error_body.append(data)
                self._error_size += len(data)
            return
        try:
            self._stream.feed(data)
        except errors.EngineError as error:
            self.fail(error)  # the events before it go out first
        else:
            if self._stream.done:
                self._end(None)  # [DONE]: the call is over; its last events wait to be read

    def complete(self, connection: _Connection) -> None:
        """Their response ended: the connection goes back to the pool if it can."""
        self.flush()
        self._connection = None
        if self._paused and connection.transport is not None:
            self._paused = False
            connection.transport.resume_reading()
        self._pool.give_back(connection)
        if self._status != 200:
            body = b"".join(self._error_body)[:MAX_ERROR_BYTES]
            self.fail(error_from_response(self._status, body))
        elif not self._stream.done:
            self.fail(errors.Failed("The upstream ended its stream without [DONE]."))

    def fail(self, error: errors.EngineError) -> None:
        if self._failure is None and not self._stream.done:
            self._failure = error
            self._drop()

    def _expire(self) -> None:
        self.fail(errors.Timeout(f"upstream did not answer within {self._timeout:g} s"))
        self.wake()

    # -- ending -----------------------------------------------------------------------

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.drop(connection)

    def _end(self, outcome: CallEnd) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if outcome is not None or not self._stream.done:
            self._drop()  # mid-response: the connection cannot be reused
        self.close(outcome)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Drops the connection (the upstream sees the client leave)."""
        self._ready.clear()
        self._end(outcome)


class OpenAIHttpUpstream:
    """An OpenAI-compatible server at a base URL (…/v1), as a worker."""

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient,
        api_key: str | None = None,
        raw_http: bool | None = None,
    ) -> None:
        """`raw_http`: stream completions over our own connections (`_RawCall`);
        None: for a plain http:// URL that no proxy variable covers. Everything
        else (https, embeddings, models, health) goes through `http`."""
        self.address = base_url.rstrip("/")
        self._http = http
        self._auth = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        root = self.address.removesuffix("/v1")
        self._health_url = f"{root}/health"
        url = urlsplit(self.address)
        host, port = url.hostname or "", url.port or 80
        if raw_http is None:
            raw_http = url.scheme == "http" and not _proxied(host)
        self._pool = _Pool(host, port) if raw_http else None
        lines = [f"Host: {url.netloc}", "Content-Type: application/json"]
        lines += [f"Authorization: {value}" for value in self._auth.values()]
        self._head = "".join(f"{line}\r\n" for line in lines)
        self._path = url.path

    def generate(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> UpstreamCall:
        """Starts their streamed completion within `timeout` seconds (over httpx:
        `timeout` bounds each read)."""
        chat = request.messages is not None
        path = "chat/completions" if chat else "completions"
        stream = _Stream(chat, request.n)
        if self._pool is not None:
            body = orjson.dumps(request_body(request))
            extra = "".join(
                f"{name}: {value}\r\n"
                for name, value in metadata
                if not _BREAKS_HEADER.search(name + value)  # never valid; httpx refuses them
            )
            head = (
                f"POST {self._path}/{path} HTTP/1.1\r\n{self._head}{extra}"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            raw = head.encode("latin-1") + body
            return _RawCall(self._pool, raw, stream, timeout, self.address, on_close)
        http_request = self._post(path, request_body(request), timeout, metadata)
        return OpenAIHttpCall(self._http, http_request, stream, self.address, on_close)

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        """Their /embeddings, as floats, within `timeout` seconds; the answer is read
        up to a bound sized by the inputs and must hold one vector per input."""
        body: dict[str, Any] = {
            "model": request.model,
            "input": [i if isinstance(i, str) else list(i) for i in request.inputs],
            "encoding_format": "float",
        }
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        if request.user:
            body["user"] = request.user
        limit = MAX_ERROR_BYTES + MAX_EMBEDDING_BYTES * len(request.inputs)
        try:
            async with asyncio.timeout(timeout):
                response = await self._http.send(
                    self._post("embeddings", body, timeout, metadata), stream=True
                )
                try:
                    content = await read_capped(response, limit + 1)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException) as error:
            raise errors.Timeout(f"upstream timed out: {error}") from None
        except httpx.TransportError as error:
            raise errors.Unavailable(f"upstream unreachable: {error}") from None
        if response.status_code != 200:
            raise _embed_error(response.status_code, content[:MAX_ERROR_BYTES])
        if len(content) > limit:
            raise errors.Failed("The upstream's embeddings are larger than the gateway takes.")
        return embeddings_from(content, request)

    def _post(
        self, path: str, body: dict[str, Any], timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> httpx.Request:
        return self._http.build_request(
            "POST",
            f"{self.address}/{path}",
            content=orjson.dumps(body),
            headers={"content-type": "application/json", **dict(metadata), **self._auth},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """Their /models, with `max_model_len` where they give it (vLLM does). They
        are said to serve every feature: what a server cannot do, it refuses, and
        its 400 (naming the parameter) reaches the client."""
        try:
            response = await self._http.get(
                f"{self.address}/models", headers=self._auth, timeout=deadline
            )
        except httpx.HTTPError as error:
            raise errors.Unavailable(f"upstream unreachable: {error}") from None
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content)
        models = response.json().get("data") or []
        return [
            ModelDescription(m["id"], int(m.get("max_model_len") or 0), features=features.ALL)
            for m in models
        ]

    async def watch_health(self, poll_interval: float) -> AsyncIterator[bool]:
        """Their /health every `poll_interval`: 200 is serving."""
        while True:
            try:
                response = await self._http.get(
                    self._health_url, headers=self._auth, timeout=poll_interval
                )
            except httpx.HTTPError as error:
                raise errors.Unavailable(f"upstream unreachable: {error}") from None
            yield response.status_code == 200
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Drops its own idle connections; the httpx client belongs to the fleet."""
        if self._pool is not None:
            self._pool.close()


def _proxied(host: str) -> bool:
    """Whether the environment sends plain HTTP to `host` through a proxy (as
    httpx would read it): such upstreams are reached through httpx."""
    proxies = getproxies()
    return bool(proxies.get("http") or proxies.get("all")) and not proxy_bypass(host)
