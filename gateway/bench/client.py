"""One OpenAI request measured as a client sees it, the way vLLM's `bench serve`
measures it: when it was sent, when each content chunk arrived, what the usage
said, and how it failed if it did.

A streamed answer is read as it arrives, inside the transport's callback: each SSE
event is parsed once, its content stamped and counted. Failures are named by kind
(`http 404 model_not_found`, `stream engine_error`, `transport ...`, `timeout`), so a
report can count them without keeping messages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.bench.http import HttpClient, TransportError


def one_per_chunk(text: str) -> int:
    """Without a tokenizer, a content chunk counts as one token (as servers stream)."""
    return 1


@dataclass(slots=True)
class Tally:
    """Running totals over every request of a run, read while it goes (progress,
    measurement windows)."""

    chunks: int = 0  # content chunks received
    tokens: int = 0  # tokens in them, as counted by the recorder's `tokens_in`
    done: int = 0  # requests over, failed ones included
    failed: int = 0


@dataclass(slots=True)
class Result:
    """One request, over."""

    sent: float  # perf_counter when the request was sent (a new connection included)
    end: float  # when its last byte arrived (or it failed)
    ttft: float | None  # seconds to the first content; None unless streamed and answered
    itl: list[float]  # gaps between successive content chunks
    chunks: int  # content chunks
    counted: int  # tokens counted from the content (`tokens_in` per chunk)
    prompt_tokens: int | None  # from usage, when the server sent it
    completion_tokens: int | None
    text: str
    error: str | None = None  # the kind of failure; None when it succeeded

    @property
    def ok(self) -> bool:
        """Answered whole."""
        return self.error is None

    @property
    def latency(self) -> float:
        """End to end, seconds."""
        return self.end - self.sent

    @property
    def output_tokens(self) -> int:
        """The usage's count when the server sent one, else the counted tokens."""
        return self.counted if self.completion_tokens is None else self.completion_tokens

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - TTFT) / (tokens - 1)."""
        tokens = self.output_tokens
        if self.ttft is None or tokens < 2:
            return None
        return (self.latency - self.ttft) / (tokens - 1)


def _error_code(body: Any) -> str | None:
    """OpenAI's error `code`, else its `type`, from `{"error": {...}}`."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    code = error.get("code") or error.get("type")
    return str(code) if code else None


class Recorder:
    """The `Sink` of one request: stamps and counts a streamed answer's content
    as it arrives, or keeps a whole answer (or an error body) to read at the end."""

    __slots__ = (
        "_buffer",
        "_first",
        "_last",
        "_pieces",
        "_tally",
        "_tokens_in",
        "chunks",
        "completion_tokens",
        "counted",
        "done",
        "end",
        "error",
        "itl",
        "prompt_tokens",
        "sent",
        "status",
        "stream",
    )

    def __init__(
        self,
        stream: bool,
        tally: Tally | None = None,
        tokens_in: Callable[[str], int] = one_per_chunk,
    ) -> None:
        self.stream = stream
        self._tally = tally if tally is not None else Tally()
        self._tokens_in = tokens_in
        self._buffer = b""
        self._pieces: list[str] = []
        self._first: float | None = None
        self._last = 0.0
        self.sent = self.end = time.perf_counter()
        self.status = 0
        self.itl: list[float] = []
        self.chunks = 0
        self.counted = 0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.done = False  # saw data: [DONE]
        self.error: str | None = None

    def start(self, status: int) -> None:
        """The response's status."""
        self.status = status

    def feed(self, data: bytes) -> None:
        """A piece of the body."""
        now = self.end = time.perf_counter()
        if not self.stream or self.status != 200:
            self._buffer += data  # a whole answer, or an error body: read in `result`
            return
        buffer = self._buffer + data
        if b"\r" in buffer:  # SSE allows CRLF lines; ours and vLLM's use LF
            buffer = buffer.replace(b"\r\n", b"\n")
        *events, self._buffer = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                self._data(event[6:], now)
            else:  # several lines, comments, other fields: keep the data lines
                lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
                if lines:
                    self._data(b"\n".join(line[5:].removeprefix(b" ") for line in lines), now)

    def _data(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = "stream bad_json"
            return
        if "error" in chunk:
            self.error = f"stream {_error_code(chunk) or 'error'}"
            return
        self._usage(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta")
            if delta is not None:
                text = delta.get("content") or delta.get("reasoning_content")
            else:
                text = choice.get("text")
            if text:
                self._content(text, now)

    def _content(self, text: str, now: float) -> None:
        if self._first is None:
            self._first = now
        else:
            self.itl.append(now - self._last)
        self._last = now
        tokens = self._tokens_in(text)
        self.chunks += 1
        self.counted += tokens
        self._tally.chunks += 1
        self._tally.tokens += tokens
        self._pieces.append(text)

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)

    def _answer(self) -> None:
        """A whole, non-streamed answer."""
        try:
            body = orjson.loads(self._buffer)
            choice = body["choices"][0]
            message = choice.get("message")
            text = message.get("content") if message is not None else choice.get("text")
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            self.error = "answer bad_json"
            return
        self._usage(body.get("usage"))
        if text:
            self._content(text, self.end)

    def fail(self, kind: str) -> Result:
        """The request failed before its response was whole."""
        self.end = time.perf_counter()
        self.error = kind
        return self.result()

    def result(self) -> Result:
        """The request, over."""
        if self.error is None:
            if self.status != 200:
                self.error = " ".join(filter(None, ["http", str(self.status), self._code()]))
            elif not self.stream:
                self._answer()
            elif not self.done:
                self.error = "stream incomplete"  # ended without data: [DONE]
        ok = self.error is None
        self._tally.done += 1
        self._tally.failed += not ok
        return Result(
            sent=self.sent,
            end=self.end,
            ttft=self._first - self.sent if ok and self.stream and self._first else None,
            itl=self.itl,
            chunks=self.chunks,
            counted=self.counted,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            text="".join(self._pieces),
            error=self.error,
        )

    def _code(self) -> str | None:
        try:
            return _error_code(orjson.loads(self._buffer))
        except orjson.JSONDecodeError:
            return None


def v1_url(base_url: str) -> str:
    """The OpenAI base URL: as given, or with /v1 when it names only the server."""
    base = base_url.rstrip("/")
    return base + "/v1" if urlsplit(base).path == "" else base


@dataclass
class OpenAIClient:
    """An OpenAI-compatible server at `base_url` (`http://host:port/v1`)."""

    base_url: str
    api_key: str | None = None
    timeout: float = 600.0  # seconds, for a whole request
    http: HttpClient = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        self.http = HttpClient(v1_url(self.base_url), headers)

    async def models(self) -> list[str]:
        """The ids `GET /models` lists; raises `TransportError` or `RuntimeError`."""
        status, body = await self.http.get("/models")
        if status != 200:
            raise RuntimeError(f"GET /models answered {status}: {body[:200]!r}")
        return [model["id"] for model in orjson.loads(body)["data"]]

    async def post(
        self, path: str, body: bytes, recorder: Recorder, priority: int | None = None
    ) -> Result:
        """POSTs `body` to `path` (`/chat/completions`), read by `recorder`, with an
        `x-furnace-priority` header when `priority` is given; every failure ends up in
        the result."""
        extra = "" if priority is None else f"x-furnace-priority: {priority}\r\n"
        request = self.http.head("POST", path, len(body), extra) + body
        recorder.sent = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                await self.http.send(request, recorder)
        except TimeoutError:
            return recorder.fail("timeout")
        except TransportError as error:
            return recorder.fail(f"transport {error.kind}")
        return recorder.result()

    def close(self) -> None:
        """Drops the connections."""
        self.http.close()
