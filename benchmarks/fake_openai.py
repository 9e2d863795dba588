"""A fast fake OpenAI engine for side-by-side benchmarks of gateways that front
OpenAI-compatible HTTP servers (`benchmarks/bench_peers.py`).

It echoes the words of the last message (or of the completion prompt), at most
`max_tokens` of them, one word per token and one SSE event per token, each written
in its own send on its own turn of the loop, as an engine that emits a token per
step does; then the finish chunk, the usage chunk (with `stream_options.include_usage`)
and `[DONE]`. A chat answer opens with vLLM's chunk of the role and empty content,
written with the first token as vLLM's server writes it (the head goes out at once, the
role when the engine's first output comes), and its chunks are spelled as vLLM's
(`"logprobs":null`). With `--step-ms` a token
goes out every that many milliseconds, as a real engine's steps pace them: a gateway
then reads about one event a read, as it does in front of vLLM, where without it
(as fast as the loop turns) one read carries many and hides the cost of each. The
streams share the steps, as a batch does: their tokens of a step go out together. Not
streamed: one JSON answer. It answers `GET /health` and `GET /v1/models` (with
`max_model_len`, as vLLM does) for the gateways' probes.

A request whose `user` is `first-token-ms=N` waits N milliseconds before its first
token (a streamed answer's head goes out at once), as a GPU engine's prefill would;
the gateways pass `user` on as they get it (bench_peers' column of that name).

It is a raw asyncio protocol over httptools on uvloop, with every constant byte
string built once, so a token costs the engine a few microseconds and the
gateways in front of it, not the engine, set the pace. It honours the socket's
flow control (a reader that falls behind pauses its streams) as vLLM's uvicorn
does, so a slow gateway cannot hide its backlog in the engine's buffers.

Run: `python -m benchmarks.fake_openai --port N [--model NAME] [--step-ms MS]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any, cast

import httptools
import orjson
import uvloop

MODEL = "fake-engine"
MAX_MODEL_LEN = 4096


class Steps:
    """An engine's steps, `step` seconds apart, shared by the streams as a batch shares
    them: those waiting for the next one wake together (also `fake_vllm_grpc`'s)."""

    def __init__(self, step: float) -> None:
        self.step = step
        self._stepping: list[asyncio.Future[None]] = []  # the streams waiting for the step

    def next(self) -> asyncio.Future[None]:
        """Done at the engine's next step."""
        loop = asyncio.get_running_loop()
        if not self._stepping:
            loop.call_later(self.step, self._stepped)
        waiter = loop.create_future()
        self._stepping.append(waiter)
        return waiter

    def _stepped(self) -> None:
        waiters, self._stepping = self._stepping, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class Engine:
    """The answers' constant parts, built once for the model name."""

    def __init__(self, model: str, step: float = 0.0) -> None:
        name = orjson.dumps(model)
        self.step = step  # seconds between two tokens (0: a turn of the loop)
        self._steps = Steps(step)
        self.chat_head = (
            b'data: {"id":"chatcmpl-fake","object":"chat.completion.chunk","created":1,'
            b'"model":' + name + b',"choices":[{"index":0,"delta":{"content":'
        )
        self.chat_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        self.chat_role = _chunk(
            self.chat_head.replace(b'"content":', b'"role":"assistant","content":""')
            + self.chat_tail
        )
        self.text_head = (
            b'data: {"id":"cmpl-fake","object":"text_completion","created":1,"model":'
            + name
            + b',"choices":[{"index":0,"text":'
        )
        self.text_tail = b',"finish_reason":null}]}\n\n'
        self.models = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": 1,
                        "owned_by": "bench",
                        "max_model_len": MAX_MODEL_LEN,
                    }
                ],
            }
        )
        self.model = model

    def next_step(self) -> asyncio.Future[None] | None:
        """Done at the engine's next step, which every stream waiting for it shares (a
        batch: their tokens go out together, as vLLM's do); None without `step`."""
        return self._steps.next() if self.step else None


def _chunk(data: bytes) -> bytes:
    """One piece of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


_FIRST_TOKEN = "first-token-ms="


def first_token_wait(request: dict[str, Any]) -> float:
    """The seconds a request asks the engine to wait before its first token."""
    user = request.get("user")
    if isinstance(user, str) and user.startswith(_FIRST_TOKEN):
        with contextlib.suppress(ValueError):  # not a number: no wait
            return max(0.0, float(user[len(_FIRST_TOKEN) :]) / 1000)
    return 0.0


def _whole(status: bytes, body: bytes, kind: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        kind,
        len(body),
        body,
    )


class EngineProtocol(asyncio.Protocol):
    """One client connection: keep-alive, one request at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.writable: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        transport = self.transport
        assert transport is not None
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if method == b"GET" and path in (b"/health", b"/v1/health"):
            transport.write(_whole(b"200 OK", b""))
        elif method == b"GET" and path == b"/v1/models":
            transport.write(_whole(b"200 OK", self.engine.models))
        elif method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                request = orjson.loads(b"".join(self.body))
            except orjson.JSONDecodeError:
                transport.write(_whole(b"400 Bad Request", b'{"error":{"message":"bad json"}}'))
                return
            chat = path == b"/v1/chat/completions"
            self.task = asyncio.get_running_loop().create_task(self._answer(request, chat))
        else:
            transport.write(_whole(b"404 Not Found", b'{"error":{"message":"not found"}}'))

    async def _answer(self, request: dict[str, Any], chat: bool) -> None:
        engine, transport = self.engine, self.transport
        assert transport is not None
        if chat:
            messages = request.get("messages") or [{}]
            prompt = str(messages[-1].get("content") or "")
        else:
            prompt = str(request.get("prompt") or "")
        words = prompt.split()
        limit = request.get("max_tokens") or request.get("max_completion_tokens")
        reason = b'"stop"'
        if isinstance(limit, int) and limit < len(words):
            words, reason = words[:limit], b'"length"'
        prompt_tokens = len(prompt.split())
        usage = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
            prompt_tokens,
            len(words),
            prompt_tokens + len(words),
        )
        wait = first_token_wait(request)
        if not request.get("stream"):
            if wait:
                await asyncio.sleep(wait)
                if transport.is_closing():
                    return
            text = orjson.dumps(" ".join(words))
            key = b'"message":{"role":"assistant","content":' if chat else b'"text":'
            close = b"}" if chat else b""
            body = (
                b'{"id":"fake","object":"%s","created":1,"model":%s,"choices":[{"index":0,%s%s%s,'
                b'"finish_reason":%s}],"usage":%s}'
                % (
                    b"chat.completion" if chat else b"text_completion",
                    orjson.dumps(engine.model),
                    key,
                    text,
                    close,
                    reason,
                    usage,
                )
            )
            transport.write(_whole(b"200 OK", body))
            return
        head, tail = (
            (engine.chat_head, engine.chat_tail) if chat else (engine.text_head, engine.text_tail)
        )
        transport.write(STREAM_HEAD)
        # vLLM's role chunk leaves with its first token (its first engine output)
        opening = engine.chat_role if chat else b""
        if wait:
            await asyncio.sleep(wait)
        for i, word in enumerate(words):
            step = engine.next_step()
            if step is None:
                await asyncio.sleep(0)  # one token per turn: every stream gets its turn
            else:
                await step
            if self.writable is not None:
                await self.writable
            if transport.is_closing():
                return
            token = word if i == 0 else " " + word
            transport.write(opening + _chunk(head + orjson.dumps(token) + tail))
            opening = b""
        await asyncio.sleep(0)
        finish = (
            b'{"index":0,"delta":{},"finish_reason":%s}' % reason
            if chat
            else b'{"index":0,"text":"","finish_reason":%s}' % reason
        )
        ending = [b'data: {"id":"fake","model":"x","choices":[%s]}\n\n' % finish]
        options = request.get("stream_options") or {}
        if options.get("include_usage"):
            ending.append(b'data: {"id":"fake","model":"x","choices":[],"usage":%s}\n\n' % usage)
        if not transport.is_closing():
            transport.write(opening + b"".join(_chunk(e) for e in ending) + DONE)


async def serve(host: str, port: int, model: str, step_ms: float = 0.0) -> None:
    """Serves until the process is terminated."""
    engine = Engine(model, step_ms / 1000)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EngineProtocol(engine), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description="A fast fake OpenAI engine (SSE per token).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="ms between two tokens (0: a turn of the loop)"
    )
    args = parser.parse_args()
    uvloop.run(serve(args.host, args.port, args.model, args.step_ms))


if __name__ == "__main__":
    main()
