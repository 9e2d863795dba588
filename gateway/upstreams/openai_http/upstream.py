"""`OpenAIHttpUpstream`, the worker the fleet holds, and `OpenAIHttpCall`, a streamed
call over the fleet's httpx client: they pick the way of each call (raw connections or
httpx), build its request from `translate`, and read it through `sse`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

import httpx
import orjson

from gateway.protocol import errors, features
from gateway.protocol.chat import message_dict
from gateway.protocol.http1 import Pool, fetch
from gateway.protocol.kv_blocks import EngineLoad
from gateway.protocol.types import (
    AudioRequest,
    Classifications,
    Embeddings,
    EmbedRequest,
    Event,
    GenerateRequest,
    RerankRequest,
    Scores,
    Tokens,
    Transcript,
)
from gateway.upstreams.base import (
    CANCELLED,
    HEAD_GRACE,
    CallEnd,
    ModelDescription,
    StreamBookkeeping,
    UpstreamCall,
    engine_address,
    engine_rank,
)
from gateway.upstreams.openai_http.audio import (
    MAX_TRANSCRIPT_BYTES,
    TranscriptStream,
    form_of,
    transcript_from,
)
from gateway.upstreams.openai_http.connections import _RawCall
from gateway.upstreams.openai_http.loads import (
    LOAD_QUERY,
    MAX_METRICS_BYTES,
    engine_load,
    engine_ranks,
)
from gateway.upstreams.openai_http.polls import SharedPolls
from gateway.upstreams.openai_http.sse import IdsStream, _Stream
from gateway.upstreams.openai_http.translate import (
    MAX_EMBEDDING_BYTES,
    MAX_ERROR_BYTES,
    MAX_MODELS_BYTES,
    _pooling_error,
    classifications_from,
    embeddings_from,
    error_from_response,
    kv_transfer_from,
    prefill_body,
    read_capped,
    request_body,
    rerank_limit,
    scores_from,
    text_detokenized,
    tokenize_body,
    tokens_counted,
    tokens_from,
)

#: The most of a `/tokenize` or `/detokenize` answer read: a 4 MiB prompt (the default
#: `max_body_bytes`) is about a million tokens, 8-20 MiB of ids and their strings.
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
#: The most of a prefill's answer read: one token's choice and where its KV blocks are
#: (with logprobs, a few KiB).
MAX_PREFILL_BYTES = 1024 * 1024
#: What one id's text may take in a `/detokenize` answer (a long token, JSON-escaped).
DETOKENIZED_BYTES_AN_ID = 256

T = TypeVar("T")

_CLOSING: set[asyncio.Task[None]] = set()
_BREAKS_HEADER = re.compile(r"[\r\n\x00]")  # upstream responses being closed after a cancel


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
        self._failure: errors.GatewayError | None = None  # found after events still to give
        self._first: asyncio.Task[None] | None = None  # the first read, past the grace

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
            first, self._first = self._first, None
            await (self._read() if first is None else first)
            return self._ready.popleft()
        except errors.GatewayError as error:
            await self._finish(error)
            raise
        except httpx.TimeoutException as error:
            failure: errors.GatewayError = errors.Timeout(f"upstream timed out: {error}")
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
        # Started waits for their first event, at most `HEAD_GRACE`: a refusal they
        # stream (vLLM's 400s found after its headers) is then still a refusal,
        # answered as its status, and past it the edge's head goes out while the engine
        # prefills. A pending httpx read cannot be interrupted: it runs as a task, which
        # the next read awaits (or `cancel()` cancels).
        first = asyncio.ensure_future(self._read())
        first.add_done_callback(_retrieved)
        try:
            grace = HEAD_GRACE if self._stream.grace else None
            done, _ = await asyncio.wait((first,), timeout=grace)
        except asyncio.CancelledError:
            first.cancel()
            raise
        if done:
            first.result()  # their refusal raises here
        else:
            self._first = first
        return self._stream.started()

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
            except errors.GatewayError as error:
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
        if self._first is not None:
            self._first.cancel()
            self._first = None
        if self._response is not None:
            closing = asyncio.get_running_loop().create_task(self._response.aclose())
            _CLOSING.add(closing)  # the loop keeps only a weak reference to a task
            closing.add_done_callback(_CLOSING.discard)
        self.close(outcome)


def _within(status: int, content: bytes, limit: int, what: str) -> None:
    """A 200's answer (read up to `limit` + 1 bytes) past `limit` bytes is `Failed`: the
    upstream's `what` answer too large."""
    if status == 200 and len(content) > limit:
        raise errors.Failed(f"The upstream's {what} answer is larger than the gateway takes.")


def _retrieved(task: asyncio.Task[None]) -> None:
    """A first read's failure is raised by the read that awaits it; one that no read
    awaits (the call was cancelled) is marked seen, so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


class OpenAIHttpUpstream:
    """An OpenAI-compatible server at a base URL (…/v1), as a worker."""

    def __init__(
        self,
        base_url: str,
        http: httpx.AsyncClient,
        api_key: str | None = None,
        data_parallel_rank: int | None = None,
        raw_http: bool | None = None,
        polls: SharedPolls | None = None,
    ) -> None:
        """`data_parallel_rank`: one engine of a data-parallel vLLM server
        (`gateway.fleet.data_parallel`), every request pinned to it (vLLM's
        `X-data-parallel-rank`) and its load read from that engine's samples; `polls`:
        the server's polls, shared by its engines' upstreams.
        `raw_http`: stream completions, and poll health and load, over our own
        connections (`_RawCall`, `fetch`); None: for a plain http:// URL that no proxy
        variable covers. Everything else (https, embeddings, models) goes through `http`."""
        self.address = base_url.rstrip("/")
        #: The worker its calls name: the address, and the engine's rank.
        self.name = engine_address(self.address, data_parallel_rank)
        self._http = http
        #: Sent with every request: the key, the engine's rank.
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._rank = data_parallel_rank
        #: Its engine's data-parallel rank, as its server's `/metrics` names it (`engines`).
        self.engine_rank = data_parallel_rank
        self._polls = polls
        if data_parallel_rank is not None:
            self._headers["X-data-parallel-rank"] = str(data_parallel_rank)
        #: Where vLLM serves what is not OpenAI's (`/health`, `/tokenize`, `/classify`).
        self._root = root = self.address.removesuffix("/v1")
        self._health_url = f"{root}/health"
        self._metrics_page = f"{root}/metrics"
        self.metrics_url = f"{root}/metrics/?{LOAD_QUERY}"  # the page, until refused
        #: The engines its server runs (`engines`), and whether that was read yet.
        self._engines: tuple[int, ...] | None = None
        self._engines_read = False
        url = urlsplit(self.address)
        host, port = url.hostname or "", url.port or 80
        if raw_http is None:
            raw_http = url.scheme == "http" and not _proxied(host)
        self._pool = Pool(host, port) if raw_http else None
        lines = [f"Host: {url.netloc}", "Content-Type: application/json"]
        lines += [f"{name}: {value}" for name, value in self._headers.items()]
        self._head = "".join(f"{line}\r\n" for line in lines)
        # A streamed call's request line and fixed headers, for a chat and for a completion.
        self._starts = {
            chat: f"POST {url.path}/{path} HTTP/1.1\r\n{self._head}"
            for chat, path in ((True, "chat/completions"), (False, "completions"))
        }

    def call(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> UpstreamCall:
        """Starts their streamed completion within `timeout` seconds (over httpx:
        `timeout` bounds each read)."""
        chat = request.messages is not None
        stream = (IdsStream if request.return_token_ids else _Stream)(chat, request.n)
        if self._pool is not None:
            raw = self._raw_post(chat, orjson.dumps(request_body(request)), metadata)
            return _RawCall(self._pool, raw, stream, timeout, self.name, on_close)
        path = "chat/completions" if chat else "completions"
        http_request = self._post(path, request_body(request), timeout, metadata)
        return OpenAIHttpCall(self._http, http_request, stream, self.name, on_close)

    def _raw_post(self, chat: bool, body: bytes, metadata: tuple[tuple[str, str], ...]) -> bytes:
        """A chat's (or a completion's) POST of `body` as our own connections send it."""
        if _BREAKS_HEADER.search("".join(map("".join, metadata))):  # rare: one pass finds none
            metadata = tuple(  # never valid; httpx refuses them
                (name, value) for name, value in metadata if not _BREAKS_HEADER.search(name + value)
            )
        extra = "".join(map("%s: %s\r\n".__mod__, metadata))  # each a (name, value)
        head = f"{self._starts[chat]}{extra}Content-Length: {len(body)}\r\n\r\n"
        return head.encode("latin-1") + body

    async def prefill(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (also the request's own httpx timeout, in `_post`)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> GenerateRequest:
        """Their prefill of the request's prompt (one token, whole: `prefill_body`), its KV
        blocks kept for a decode worker, within `timeout` seconds (`Prefills`): the
        request with where the blocks are; a refusal as our error. Over our own
        connections where the calls and the polls use them."""
        chat = request.messages is not None
        body, limit = prefill_body(request), MAX_PREFILL_BYTES
        if self._pool is None:
            path = "chat/completions" if chat else "completions"
            status, content = await self._post_capped(
                path, body, limit, "prefill", timeout, metadata
            )
        else:
            raw = self._raw_post(chat, orjson.dumps(body), metadata)
            status, content = await self._fetch(raw, timeout, limit + 1)
            _within(status, content, limit, "prefill")
        if status != 200:
            raise error_from_response(status, content[:MAX_ERROR_BYTES])
        return replace(request, kv_transfer=kv_transfer_from(content))

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        """Their /embeddings, as floats, within `timeout` seconds; the answer is read
        up to a bound sized by the inputs and must hold one vector per input (per
        conversation, in the chat form, which they render)."""
        body = _inputs_body(request) if request.chat is None else _chat_body(request)
        body["encoding_format"] = "float"
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        limit = MAX_ERROR_BYTES + MAX_EMBEDDING_BYTES * request.count
        content = await self._pooled("embeddings", body, limit, "embeddings", timeout, metadata)
        return embeddings_from(content, request)

    async def classify(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the Classifies interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Classifications:
        """Their `/classify` (beside `/v1`, as vLLM serves a classification model), within
        `timeout` seconds; the answer is read up to a bound sized by the inputs and must
        hold one classification per input (one for the chat form's conversation, which
        they render)."""
        limit = MAX_ERROR_BYTES + MAX_EMBEDDING_BYTES * request.count
        url = f"{self._root}/classify"
        body = _inputs_body(request) if request.chat is None else _chat_body(request)
        content = await self._pooled(url, body, limit, "classification", timeout, metadata)
        return classifications_from(content, request)

    async def rerank(
        self,
        request: RerankRequest,
        timeout: float,  # noqa: ASYNC109 (the Reranks interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Scores:
        """Their `/rerank` (a cross-encoder's: vLLM's `--runner pooling` with a
        classification model), every document scored, within `timeout` seconds; the
        answer is read up to a bound sized by the documents (`rerank_limit`)."""
        body: dict[str, Any] = {
            "model": request.model,
            "query": request.query,
            "documents": list(request.documents),
        }
        if request.user:
            body["user"] = request.user
        limit = rerank_limit(request)
        content = await self._pooled("rerank", body, limit, "reranking", timeout, metadata)
        return scores_from(content, request)

    async def _pooled(
        self,
        path: str,
        body: dict[str, Any],
        limit: int,
        serves: str,
        timeout: float,  # noqa: ASYNC109 (also the request's own httpx timeout, in `_post`)
        metadata: tuple[tuple[str, str], ...],
    ) -> bytes:
        """A pooling model's answer at `path` (under `/v1`, or a whole URL): `body` sent
        within `timeout` seconds, at most `limit` bytes of the answer read (more is
        `Failed`); a refusal as our error, a route the server lacks saying the model
        serves no `serves`."""
        status, content = await self._post_capped(path, body, limit, serves, timeout, metadata)
        if status != 200:
            raise _pooling_error(status, content[:MAX_ERROR_BYTES], serves)
        return content

    async def _post_capped(
        self,
        path: str,
        body: dict[str, Any],
        limit: int,
        what: str,
        timeout: float,  # noqa: ASYNC109 (also the request's own httpx timeout, in `_post`)
        metadata: tuple[tuple[str, str], ...],
    ) -> tuple[int, bytes]:
        """`body` POSTed to `path` (under `/v1`, or a whole URL) within `timeout` seconds:
        the status and the answer, of which a 200's past `limit` bytes is `Failed` (the
        upstream's `what` answer too large)."""
        request = self._post(path, body, timeout, metadata)
        status, content = await self._send(request, timeout, limit + 1)
        _within(status, content, limit, what)
        return status, content

    async def count_tokens(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """The prompt's tokens by the server's own tokenizer and template: vLLM's
        `/tokenize` (beside `/v1`); a server without it cannot count, a 400 naming
        `model`. vLLM's answer lists the ids too (a 10,000-token prompt's are about
        60 KB): read as `tokenize`'s."""
        body = tokenize_body(request)
        url, limit = f"{self._root}/tokenize", MAX_TOKENIZER_BYTES
        status, content = await self._post_capped(url, body, limit, "/tokenize", timeout, metadata)
        return tokens_counted(status, content)

    async def tokenize(
        self,
        request: GenerateRequest,
        token_strs: bool,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Tokens:
        """The prompt's ids (and strings) by vLLM's `/tokenize`, at most
        `MAX_TOKENIZER_BYTES` of its answer read (`count_tokens`' refusals)."""
        body = tokenize_body(request)
        body["return_token_strs"] = token_strs
        url, limit = f"{self._root}/tokenize", MAX_TOKENIZER_BYTES
        status, content = await self._post_capped(url, body, limit, "/tokenize", timeout, metadata)
        return tokens_from(status, content, token_strs)

    async def detokenize(
        self,
        model: str,
        ids: list[int],
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> str:
        """The text of `ids` by vLLM's `/detokenize`, its answer read up to a bound the
        ids size (`DETOKENIZED_BYTES_AN_ID` each, at most `MAX_TOKENIZER_BYTES`)."""
        limit = min(MAX_TOKENIZER_BYTES, MAX_ERROR_BYTES + DETOKENIZED_BYTES_AN_ID * len(ids))
        body = {"model": model, "tokens": ids}
        url = f"{self._root}/detokenize"
        status, content = await self._post_capped(
            url, body, limit, "/detokenize", timeout, metadata
        )
        return text_detokenized(status, content)

    async def transcribe(
        self,
        request: AudioRequest,
        timeout: float,  # noqa: ASYNC109 (the Transcribes interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
        on_text: Callable[[str], Awaitable[None]] | None = None,
    ) -> Transcript:
        """Their `/audio/transcriptions` (or `/audio/translations`), the file and fields as
        a form, within `timeout` seconds: a whole answer read up to `MAX_TRANSCRIPT_BYTES`,
        or a stream's texts handed to `on_text` as they come (an event at most
        `MAX_EVENT_BYTES`). A server without the route says the model serves no speech
        to text (a 400 naming `model`)."""
        path = "audio/translations" if request.translate else "audio/transcriptions"
        data, files = form_of(request)
        http_request = self._http.build_request(
            "POST",
            f"{self.address}/{path}",
            data=data,
            files=files,
            headers={**dict(metadata), **self._headers},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )
        as_text = ("response_format", "text") in request.fields
        return await self._exchange(
            http_request, timeout, lambda response: _transcript(response, as_text, on_text)
        )

    async def load_adapter(self, name: str, path: str, timeout: float) -> None:  # noqa: ASYNC109
        """Loads the LoRA adapter `name` from `path` (vLLM's `/v1/load_lora_adapter`,
        beside `/v1/models`), within `timeout` seconds. One already loaded (vLLM's 400
        says so) is loaded; a server that has no such route (vLLM without
        `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) or refuses (no adapter at that path) is
        `Failed`, naming the adapter (its operator's to fix, not the client's); one
        unreachable or unavailable is `Unavailable`."""
        body = {"lora_name": name, "lora_path": path}
        status, content = await self._send(
            self._post("load_lora_adapter", body, timeout, ()), timeout, MAX_ERROR_BYTES
        )
        if status == 200 or (status == 400 and b"already been loaded" in content):
            return
        reason = error_from_response(status, content).message[:512]
        if status == 404 and b'"Not Found"' in content:  # no such route: FastAPI's own 404
            reason = "it loads no adapters at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
        failure = errors.Unavailable if status in (502, 503, 504) else errors.Failed
        raise failure(f"The worker could not load the adapter `{name}`: {reason}")

    async def _send(
        self,
        request: httpx.Request,
        timeout: float,  # noqa: ASYNC109 (also the request's own httpx timeout, in `_post`)
        limit: int,
    ) -> tuple[int, bytes]:
        """`request` sent within `timeout` seconds: its status and at most `limit` bytes
        of its answer."""

        async def read(response: httpx.Response) -> tuple[int, bytes]:
            return response.status_code, await read_capped(response, limit)

        return await self._exchange(request, timeout, read)

    async def _exchange(
        self,
        request: httpx.Request,
        timeout: float,  # noqa: ASYNC109 (also the request's own httpx timeout)
        read: Callable[[httpx.Response], Awaitable[T]],
    ) -> T:
        """`request` sent within `timeout` seconds and its answer read by `read` (the
        response closed after, however it ends); httpx's timeouts and transport errors as
        ours."""
        try:
            async with asyncio.timeout(timeout):
                response = await self._http.send(request, stream=True)
                try:
                    return await read(response)
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException) as error:
            raise errors.Timeout(f"upstream timed out: {error}") from None
        except httpx.TransportError as error:
            raise errors.Unavailable(f"upstream unreachable: {error}") from None

    async def _get(self, url: str, timeout: float, limit: int) -> tuple[int, bytes]:  # noqa: ASYNC109
        """A poll's GET of `url` (theirs) within `timeout` seconds: its status and at most
        `limit` bytes of its answer; the answer of the same GET for another engine of
        their server where it shares its polls (`SharedPolls`)."""
        if self._polls is not None:
            return await self._polls.get(url, partial(self._send_get, url, timeout, limit))
        return await self._send_get(url, timeout, limit)

    async def _send_get(self, url: str, timeout: float, limit: int) -> tuple[int, bytes]:  # noqa: ASYNC109
        """`_get`'s GET, sent: over our own connections where the calls use them
        (`fetch`: a poll of health or load costs about a tenth of httpx's CPU)."""
        if self._pool is None:
            request = self._http.build_request("GET", url, headers=self._headers, timeout=timeout)
            return await self._send(request, timeout, limit)
        target = urlsplit(url)
        path = target.path + (f"?{target.query}" if target.query else "")
        raw = f"GET {path} HTTP/1.1\r\n{self._head}\r\n".encode("latin-1")
        return await self._fetch(raw, timeout, limit)

    async def _fetch(self, raw: bytes, timeout: float, limit: int) -> tuple[int, bytes]:  # noqa: ASYNC109
        """`raw` sent on our own connections (`fetch`: sent again on a new one when a
        kept-alive one was closed under it before any answer) within `timeout` seconds:
        its status and at most `limit` bytes of its answer; the failures as ours."""
        assert self._pool is not None
        try:
            return await fetch(self._pool, raw, limit, timeout)
        except TimeoutError as error:
            raise errors.Timeout(f"upstream timed out: {error!r}") from None
        except OSError as error:
            raise errors.Unavailable(f"upstream unreachable: {error}") from None

    def _post(
        self, path: str, body: dict[str, Any], timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> httpx.Request:
        return self._http.build_request(
            "POST",
            path if "://" in path else f"{self.address}/{path}",
            content=orjson.dumps(body),
            headers={"content-type": "application/json", **dict(metadata), **self._headers},
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
        )

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """Their /models, with `max_model_len` where they give it (vLLM does), and the
        data-parallel engines their server runs where its `/metrics` says (`engines`).
        They are said to serve every feature: what a server cannot do, it refuses, and
        its 400 (naming the parameter) reaches the client."""
        # over our own connections where the calls use them, as the health and load
        # polls: through httpx a poll of a worker took about 13,000 bytecodes of the loop
        status, content = await self._get(f"{self.address}/models", deadline, MAX_MODELS_BYTES + 1)
        if status != 200:
            raise error_from_response(status, content[:MAX_ERROR_BYTES])
        if len(content) > MAX_MODELS_BYTES:  # a 200 MiB answer took 1.36 GB at start
            raise errors.Failed("The upstream's /models answer is larger than the gateway takes.")
        try:
            payload = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise errors.Failed("The upstream's /models answer is not JSON.") from None
        models = (payload.get("data") if type(payload) is dict else None) or []
        engines = await self.engines(deadline)
        return [
            ModelDescription(
                m["id"],
                int(m.get("max_model_len") or 0),
                features=features.ALL,
                engine_ranks=engines,
            )
            for m in models
        ]

    async def engine_load(self, timeout: float) -> EngineLoad | None:  # noqa: ASYNC109
        """Their engine's load from their Prometheus `/metrics` (beside `/v1`; `loads`),
        within `timeout` seconds; None when the page has no vLLM scheduler gauges or
        there is no such page (404): not a vLLM."""
        return await self._gauges(timeout, partial(engine_load, engine=self.engine_rank))

    async def _gauges(
        self,
        timeout: float,  # noqa: ASYNC109
        read: Callable[[bytes, bool], T | None],
    ) -> T | None:
        """What `read` finds in their `/metrics` (the page, and whether it was cut at the
        read bound), None for a 404. It asks for vLLM's scheduler gauges alone
        (`LOAD_QUERY` at `/metrics/`, where vLLM mounts prometheus-client's own app,
        which filters; its `/metrics` does not); a server that answers that with
        anything but a running gauge is read whole at `/metrics` from then on (one
        engine's missing samples are that engine's, not the page's, fault)."""
        url = self.metrics_url
        status, content = await self._get(url, timeout, MAX_METRICS_BYTES)
        cut = len(content) >= MAX_METRICS_BYTES
        if url != self._metrics_page and (status != 200 or engine_ranks(content, cut) is None):
            self.metrics_url = self._metrics_page
            return await self._gauges(timeout, read)
        if status == 404:
            return None
        if status != 200:
            raise error_from_response(status, content[:MAX_ERROR_BYTES])
        return read(content, cut)

    async def engines(self, deadline: float) -> tuple[int, ...] | None:
        """The data-parallel ranks of the engines their server runs, as its `/metrics`
        samples them (`engine_ranks`); None where it does not say (not a vLLM, no page,
        or no answer now). Read at every describe of one engine of such a server (a
        server restarted with fewer engines is seen), which then knows its engine's rank
        (`base.engine_rank`: past its index under hybrid load balancing); of a whole
        server, at its first."""
        rank = self._rank
        if rank is None and self._engines_read:
            return self._engines
        try:
            self._engines = await self._gauges(deadline, engine_ranks)
        except errors.GatewayError:
            return None
        self._engines_read = True
        if rank is not None:
            self.engine_rank = engine_rank(self._engines, rank)
        return self._engines

    async def watch_health(self, poll_interval: float, deadline: float) -> AsyncIterator[bool]:
        """Their /health every `poll_interval`: 200 is serving (its body is not read
        past `MAX_ERROR_BYTES`)."""
        while True:
            status, _ = await self._get(self._health_url, deadline, MAX_ERROR_BYTES)
            yield status == 200
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Drops its own idle connections; the httpx client belongs to the fleet."""
        if self._pool is not None:
            self._pool.close()


async def _transcript(
    response: httpx.Response, as_text: bool, on_text: Callable[[str], Awaitable[None]] | None
) -> Transcript:
    """A transcription's answer: a refusal as our error (a server without the route: the
    model serves no speech to text), a whole transcript read up to `MAX_TRANSCRIPT_BYTES`,
    or a stream's texts handed to `on_text` as they come."""
    if response.status_code != 200:
        content = await read_capped(response, MAX_ERROR_BYTES)
        raise _pooling_error(response.status_code, content, "speech to text")
    kind = response.headers.get("content-type", "")
    if on_text is None or not kind.startswith("text/event-stream"):
        content = await read_capped(response, MAX_TRANSCRIPT_BYTES + 1)
        if len(content) > MAX_TRANSCRIPT_BYTES:
            raise errors.Failed("The upstream's transcript is larger than the gateway takes.")
        return transcript_from(kind, content, as_text)
    stream = TranscriptStream()
    async for chunk in response.aiter_bytes():
        for text in stream.feed(chunk):
            await on_text(text)
        if stream.done:
            break
    if not stream.done:
        raise errors.Failed("The upstream's transcript stream ended before its end.")
    return stream.transcript()


def _inputs_body(request: EmbedRequest) -> dict[str, Any]:
    """An embeddings or classify body's inputs (token ids as lists) and model, and `user`
    where given."""
    body: dict[str, Any] = {
        "model": request.model,
        "input": [i if isinstance(i, str) else list(i) for i in request.inputs],
    }
    if request.user:
        body["user"] = request.user
    return body


def _chat_body(request: EmbedRequest) -> dict[str, Any]:
    """An embeddings body in vLLM's chat form: its conversation (or its batch of them) and
    the template's options where they ask something, and `user` where given."""
    chat = request.chat
    assert chat is not None
    conversations = [list(map(message_dict, c)) for c in chat.conversations]
    body: dict[str, Any] = {
        "model": request.model,
        "messages": conversations if chat.batched else conversations[0],
    }
    for name, value in (
        ("add_generation_prompt", chat.add_generation_prompt),
        ("continue_final_message", chat.continue_final_message),
        ("add_special_tokens", chat.add_special_tokens),
    ):
        if value:
            body[name] = True
    if chat.template_kwargs:
        body["chat_template_kwargs"] = orjson.loads(chat.template_kwargs)
    if request.user:
        body["user"] = request.user
    return body


def _proxied(host: str) -> bool:
    """Whether the environment sends plain HTTP to `host` through a proxy (as
    httpx would read it): such upstreams are reached through httpx."""
    proxies = getproxies()
    return bool(proxies.get("http") or proxies.get("all")) and not proxy_bypass(host)
