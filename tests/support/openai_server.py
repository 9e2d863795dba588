"""A tiny OpenAI-compatible HTTP server over TLS that asks for a bearer key: an
upstream of the kind `upstream: openai` reaches with `api_key_env` and `ca_file`.
It also embeds (`/v1/embeddings`), as vLLM's CPU build cannot quickly serve the
test model as an embedding model."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.certs import CertificateAuthority, Issued
from tests.support.processes import free_port
from tests.support.servers import ServerLoop
from tests.support.waiting import HANG_GUARD

#: The width of the server's embeddings.
DIMENSIONS = 16
#: The prompt's tokens its usage says its prefix cache held (of 3).
CACHED = 2
#: Seconds `stop` waits for the connections to close before it ends them.
STOP_GRACE = 2.0
#: With vLLM's `return_token_ids`: the prompt's ids its first chunk says, each chunk's
#: token's id after the role's (one a chunk, from `FIRST_ID`), and the end of sequence's,
#: which its finish chunk carries (as vLLM's, whose text holds none of it).
PROMPT_IDS = [101, 102, 103]
FIRST_ID = 7
EOS_ID = 2


def embedding(item: str | list[int], dimensions: int = DIMENSIONS) -> list[float]:
    """The server's vector for a text or token ids: from their sha256, L2-normalized."""
    text = item if isinstance(item, str) else " ".join(map(str, item))
    digest = hashlib.sha256(text.encode()).digest()
    values = [b - 127.5 for b in digest[:dimensions]]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


class OpenAIServer:
    """Serves `model` on https://127.0.0.1:port/v1 to clients with `key`; it
    answers every chat with `reply` (a chat whose tool_choice names a function: with a
    call of it and finish_reason "tool_calls", as OpenAI does), embeds every input
    (`embedding`), keeps the last body it was sent, and counts the calls it refused."""

    def __init__(self, model: str, key: str, cert: Issued | None, reply: str = "hello") -> None:
        self.model, self.key, self.reply = model, key, reply
        #: A reasoning model's: pieces of reasoning sent before the reply, each in a
        #: chunk's delta under `reasoning_field` (vLLM's name; `reasoning_content` before
        #: it), the last one in the chunk that starts the reply, as vLLM's parsers do.
        self.reasoning: list[str] = []
        self.reasoning_field = "reasoning"
        #: Seconds between a chat stream's chunks (an engine's steps); 0: all at once.
        self.pace = 0.0
        self.refused = 0
        #: The GETs of its health, models and metrics pages it answered, by path.
        self.gets: Counter[str] = Counter()
        self.last_body: dict[str, Any] = {}
        #: The engine the last chat was pinned to (vLLM's `X-data-parallel-rank`), if any.
        self.last_rank: str | None = None
        #: The last transcription's form: its fields' values, and the file's bytes.
        self.last_form: dict[str, list[str]] = {}
        self.last_audio = b""
        #: A streamed transcription's deltas sent before its connection breaks (None:
        #: it ends as OpenAI's does).
        self.break_after: int | None = None
        #: Answers a streamed transcription whole, as JSON (a server that cannot stream).
        self.whole_streams = False
        #: What its Prometheus /metrics says, in vLLM's names (two engines, as a
        #: data-parallel server's): requests running and waiting, KV-cache use; None:
        #: no /metrics (404), as a server that is not a vLLM.
        self.load: tuple[int, int, float] | None = None
        #: Set to answer /metrics with this status instead (a failing page).
        self.metrics_status = 200
        #: The data-parallel ranks of the engines its /metrics samples (the load on the
        #: first and the second; none on the others).
        self.engines: tuple[int, ...] = (0, 1)
        #: Seconds its /health takes to answer (a loaded server's).
        self.health_delay = 0.0
        self.port = free_port()
        scheme = "http" if cert is None else "https"  # without one: plain HTTP, in-cluster
        self.url = f"{scheme}://127.0.0.1:{self.port}/v1"
        app = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/metrics", self._metrics),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/audio/transcriptions", self._transcription, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            ssl_certfile=None if cert is None else cert.cert_file,
            ssl_keyfile=None if cert is None else cert.key_file,
            log_level="warning",
            lifespan="off",
            # a client's idle kept-alive connection never answers the TLS close_notify,
            # and the ssl module waits 30 s for it: stop after this many seconds anyway
            timeout_graceful_shutdown=STOP_GRACE,
        )
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    def _refusal(self, request: Request) -> Response | None:
        if request.headers.get("authorization") == f"Bearer {self.key}":
            return None
        self.refused += 1
        error = {"message": "Invalid API key.", "code": "invalid_api_key"}
        return JSONResponse({"error": error}, status_code=401)

    async def _health(self, request: Request) -> Response:
        self.gets[request.url.path] += 1
        await asyncio.sleep(self.health_delay)
        return self._refusal(request) or Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        self.gets[request.url.path] += 1
        refusal = self._refusal(request)
        return refusal or JSONResponse({"data": [{"id": self.model, "max_model_len": 4096}]})

    async def _metrics(self, request: Request) -> Response:
        self.gets[request.url.path] += 1
        if self.metrics_status != 200:
            return Response(status_code=self.metrics_status)
        if self.load is None:
            return Response(status_code=404)
        running, waiting, usage = self.load
        model = self.model

        def labels(engine: int) -> str:
            return f'engine="{engine}",model_name="{model}"'

        first, *others = self.engines
        second, rest = others[:1], others[1:]
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels(first)}}} {running - running // 2}.0",
            *(f"vllm:num_requests_running{{{labels(e)}}} {running // 2}.0" for e in second),
            *(f"vllm:num_requests_running{{{labels(e)}}} 0.0" for e in rest),
            "# TYPE vllm:num_requests_waiting_by_reason gauge",
            f'vllm:num_requests_waiting_by_reason{{{labels(first)},reason="capacity"}} 99.0',
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels(first)}}} {waiting}.0",
            *(f"vllm:num_requests_waiting{{{labels(e)}}} 0.0" for e in others),
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels(first)}}} {usage}",
            *(f"vllm:kv_cache_usage_perc{{{labels(e)}}} 0.0" for e in others),
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def _chat(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        body = self.last_body = orjson.loads(await request.body())
        self.last_rank = request.headers.get("x-data-parallel-rank")
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            call = {"index": 0, "id": "call_1", "type": "function"}
            call["function"] = {"name": choice["function"]["name"], "arguments": "{}"}
            delta, reason = {"tool_calls": [call]}, "tool_calls"
        else:
            delta, reason = {"content": self.reply}, "stop"
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        deltas += [{self.reasoning_field: piece} for piece in self.reasoning[:-1]]
        if self.reasoning:
            delta = {self.reasoning_field: self.reasoning[-1], **delta}
        deltas.append(delta)
        chunks: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
        ]
        tokens = len(deltas) - 1
        ids = bool(body.get("return_token_ids"))
        if ids:  # vLLM's: the prompt's in the role's chunk, then a token's a chunk
            chunks[0]["prompt_token_ids"] = PROMPT_IDS
            for i, chunk in enumerate(chunks[1:]):
                chunk["choices"][0]["token_ids"] = [FIRST_ID + i]
        # as vLLM's with --enable-prompt-tokens-details: CACHED of the prompt's 3 held
        usage = {
            "prompt_tokens": 3,
            "completion_tokens": tokens,
            "prompt_tokens_details": {"cached_tokens": CACHED},
        }
        finish: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": reason}
        if ids:
            finish["token_ids"] = [EOS_ID]
            usage["completion_tokens"] = tokens + 1
        chunks += [{"choices": [finish]}, {"choices": [], "usage": usage}]
        lines = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]
        if not self.pace:
            return StreamingResponse(iter(lines), media_type="text/event-stream")
        pace = self.pace

        async def paced() -> AsyncIterator[bytes]:
            for line in lines:
                yield line
                await asyncio.sleep(pace)

        return StreamingResponse(paced(), media_type="text/event-stream")

    async def _embeddings(self, request: Request) -> Response:
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        body = self.last_body = orjson.loads(await request.body())
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one input of token ids
        dimensions = body.get("dimensions") or DIMENSIONS
        if not 1 <= dimensions <= DIMENSIONS:
            error = {"message": "dimensions out of range", "param": "dimensions", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        data = [
            {"object": "embedding", "index": i, "embedding": embedding(item, dimensions)}
            for i, item in enumerate(inputs)
        ]
        tokens = sum(len(i) if isinstance(i, list) else len(i.split()) for i in inputs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        # answered in reverse: the gateway must place vectors by their index
        return JSONResponse({"object": "list", "data": data[::-1], "usage": usage})

    async def _transcription(self, request: Request) -> Response:
        """OpenAI's transcription: `reply` written down, whole (its usage in tokens, as
        gpt-4o-transcribe's) or as OpenAI's `transcript.text.delta` events, a word each
        (`pace` seconds apart), and `transcript.text.done`."""
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        async with request.form() as form:
            self.last_form = {}
            for name, value in form.multi_items():
                if isinstance(value, str):
                    self.last_form.setdefault(name, []).append(value)
                else:
                    self.last_audio = await value.read()
        usage = {"type": "tokens", "input_tokens": 7, "output_tokens": len(self.reply.split())}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        if self.last_form.get("stream") != ["true"] or self.whole_streams:
            return JSONResponse({"text": self.reply, "usage": usage})
        words = self.reply.split(" ")
        deltas = [words[0], *(" " + word for word in words[1:])]
        events = [{"type": "transcript.text.delta", "delta": d} for d in deltas]
        events.append({"type": "transcript.text.done", "text": self.reply, "usage": usage})
        cut, pace = self.break_after, self.pace

        async def body() -> AsyncIterator[bytes]:
            for i, event in enumerate(events):
                if cut is not None and i == cut:
                    raise RuntimeError("the stream breaks")  # uvicorn drops the connection
                yield b"data: " + orjson.dumps(event) + b"\n\n"
                await asyncio.sleep(pace)

        return StreamingResponse(body(), media_type="text/event-stream")

    async def start(self) -> None:
        """Listens, on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        async with asyncio.timeout(HANG_GUARD):
            while not self._server.started:  # noqa: ASYNC110 (uvicorn offers only a flag)
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stops listening and waits for the server to end."""
        self._server.should_exit = True
        if self._task is not None:
            await self._task


@contextmanager
def serving(
    loop: ServerLoop, folder: Path, model: str
) -> Iterator[tuple[OpenAIServer, CertificateAuthority]]:
    """An `OpenAIServer` of `model` with a key of its own and a certificate of a CA made
    in `folder` (for the gateway's `ca_file`), listening on `loop`; stopped after."""
    ca = CertificateAuthority(folder, "upstream-ca")
    server = OpenAIServer(model, "sk-" + secrets.token_hex(8), ca.issue("u", ips=("127.0.0.1",)))
    loop.call(server.start())
    try:
        yield server, ca
    finally:
        loop.call(server.stop())


@contextmanager
def keyed_plain(loop: ServerLoop, model: str, key_env: str, reply: str) -> Iterator[OpenAIServer]:
    """An `OpenAIServer` of `model` on plain HTTP answering `reply`, with a key of its own
    in the variable `key_env` (what a model's `api_key_env` names) while it listens on
    `loop`; stopped after."""
    server = OpenAIServer(model, "sk-" + secrets.token_hex(8), None, reply=reply)
    loop.call(server.start())
    os.environ[key_env] = server.key
    try:
        yield server
    finally:
        del os.environ[key_env]
        loop.call(server.stop())
