"""OpenAI-compatible HTTP servers as workers: vLLM, SGLang, TGI's OpenAI API, or
another furnace-gateway, behind the same fleet as gRPC workers.

Our request becomes their `/chat/completions` or `/completions` call with
`stream: true` and usage included; their server-sent events become our events;
their errors map into our error tree (`HTTP_ERRORS`), so the edge answers them
as it answers a gRPC worker's. Upstreams share one pooled `httpx.AsyncClient`
(one per private CA, `ca_file`); a model's `api_key_env` key goes as
`Authorization: Bearer` on each of its calls, and only there (never in a log or
an error). A client that leaves closes the upstream stream.

Their stream has no `Started` with the prompt's size: `Started(0)` goes out
when their headers arrive, and the prompt tokens ride on `Finished` from their
usage chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson

from gateway.protocol import errors
from gateway.protocol.types import Event, Finished, FinishReason, GenerateRequest, Started, Text
from gateway.upstreams.base import CANCELLED, CallEnd, ModelDescription, StreamBookkeeping

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
_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
#: The largest SSE line (one event) and error body read from an upstream: past them the
#: upstream is failing, and reading on would only grow the gateway's memory.
MAX_EVENT_BYTES = 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
_CLOSING: set[asyncio.Task[None]] = set()  # upstream responses being closed after a cancel


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


async def sse_lines(response: httpx.Response, limit: int) -> AsyncIterator[bytes]:
    """The lines of an event stream, read in the chunks the network gives; a line
    longer than `limit` bytes fails the stream."""
    too_large = "The upstream sent an event larger than the gateway takes."
    pending = b""
    async for chunk in response.aiter_bytes():
        if b"\n" in chunk:
            *lines, rest = (pending + chunk).split(b"\n")
            for line in lines:
                if len(line) > limit:
                    raise errors.Failed(too_large)
                yield line
            pending = rest
        else:
            pending += chunk
        if len(pending) > limit:
            raise errors.Failed(too_large)
    if pending:
        yield pending


def error_from_response(status: int, body: bytes) -> errors.EngineError:
    """Our error for an upstream's error response."""
    try:
        fields = _error_fields(orjson.loads(body))
    except orjson.JSONDecodeError:
        fields = {}
    message = str(fields.get("message") or f"upstream answered HTTP {status}")
    error_type = ERROR_CODES.get(str(fields.get("code")))
    param = fields.get("param")
    if error_type is None and status == 400 and _too_long(message, param):
        return errors.TooLong(message)
    if error_type is None:
        error_type = HTTP_ERRORS.get(status, errors.Failed if status >= 500 else errors.Invalid)
    return error_type(message, param=param if isinstance(param, str) else None)


def _too_long(message: str, param: Any) -> bool:
    """Whether a 400 without our code is a prompt beyond the context, as vLLM words it."""
    return param in TOO_LONG_PARAMS or any(m in message for m in TOO_LONG_MESSAGES)


def error_from_event(payload: dict[str, Any]) -> errors.EngineError:
    """Our error for an error event in the middle of their stream."""
    fields = _error_fields(payload)
    message = str(fields.get("message") or "upstream stream failed")
    code = fields.get("code")
    error_type = ERROR_CODES.get(str(code)) if code is not None else None
    return (error_type or errors.Failed)(message)


def request_body(request: GenerateRequest) -> dict[str, Any]:
    """Our request as an OpenAI body, streamed with usage."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.messages is not None:
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
    else:
        body["prompt"] = request.prompt or ""
    for name in ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(s, name)
        if value is not None:
            body[name] = value
    if s.max_tokens is not None:
        body["max_tokens"] = s.max_tokens
    if request.stop:
        body["stop"] = list(request.stop)
    return body


class OpenAIHttpCall(StreamBookkeeping):
    """One streamed call to an upstream, read as our events."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        request: httpx.Request,
        chat: bool,
        worker: str,
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(worker, on_close)
        self._http = http
        self._request = request
        self._chat = chat
        self._response: httpx.Response | None = None
        self._lines: AsyncIterator[bytes] | None = None
        self._reason = FinishReason.STOP
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        self._texts = 0

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._response is None:
                return await self._open()
            return await self._next_event()
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
        self._lines = sse_lines(response, MAX_EVENT_BYTES)
        return Started(0)

    async def _next_event(self) -> Event:
        assert self._lines is not None
        async for line in self._lines:
            if not line.startswith(b"data:"):
                continue  # comments (keep-alives), event names, blank separators
            data = line[5:].strip()
            if data == b"[DONE]":
                completion = self._completion_tokens
                await self._finish(None)
                return Finished(
                    self._reason, self._texts if completion is None else completion,
                    self._prompt_tokens,
                )  # fmt: skip
            event = self._event(data)
            if event is not None:
                return event
        raise errors.Failed("The upstream ended its stream without [DONE].")

    def _event(self, data: bytes) -> Event | None:
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise errors.Failed("The upstream sent an event that is not JSON.") from None
        if not isinstance(payload, dict):
            raise errors.Failed("The upstream sent an event that is not an object.")
        if "error" in payload or payload.get("object") == "error":
            raise error_from_event(payload)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._prompt_tokens = usage.get("prompt_tokens", self._prompt_tokens)
            self._completion_tokens = usage.get("completion_tokens", self._completion_tokens)
        choices = payload.get("choices") or []
        if not choices:
            return None
        choice = choices[0]
        reason = choice.get("finish_reason")
        if reason is not None:
            self._reason = _REASONS.get(reason, FinishReason.STOP)
        text = (choice.get("delta") or {}).get("content") if self._chat else choice.get("text")
        if not text:
            return None
        self._texts += 1
        return Text(text, 1)

    async def _finish(self, outcome: CallEnd) -> None:
        if self._response is not None:
            await self._response.aclose()
        self.close(outcome)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Closes the upstream connection (the upstream sees the client leave)."""
        if self._response is not None:
            closing = asyncio.get_running_loop().create_task(self._response.aclose())
            _CLOSING.add(closing)  # the loop keeps only a weak reference to a task
            closing.add_done_callback(_CLOSING.discard)
        self.close(outcome)


class OpenAIHttpUpstream:
    """An OpenAI-compatible server at a base URL (…/v1), as a worker."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, api_key: str | None = None) -> None:
        self.address = base_url.rstrip("/")
        self._http = http
        self._auth = {} if api_key is None else {"authorization": f"Bearer {api_key}"}
        root = self.address.removesuffix("/v1")
        self._health_url = f"{root}/health"

    def generate(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> OpenAIHttpCall:
        """Starts their streamed completion; `timeout` bounds each read."""
        chat = request.messages is not None
        url = f"{self.address}/{'chat/completions' if chat else 'completions'}"
        http_request = self._http.build_request(
            "POST",
            url,
            content=orjson.dumps(request_body(request)),
            headers={"content-type": "application/json", **dict(metadata), **self._auth},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )
        return OpenAIHttpCall(self._http, http_request, chat, self.address, on_close)

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """Their /models, with `max_model_len` where they give it (vLLM does)."""
        try:
            response = await self._http.get(
                f"{self.address}/models", headers=self._auth, timeout=deadline
            )
        except httpx.HTTPError as error:
            raise errors.Unavailable(f"upstream unreachable: {error}") from None
        if response.status_code != 200:
            raise error_from_response(response.status_code, response.content)
        models = response.json().get("data") or []
        return [ModelDescription(m["id"], int(m.get("max_model_len") or 0)) for m in models]

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
        """Nothing of its own to close: the pooled client belongs to the fleet."""
