"""The generation routes, as raw ASGI endpoints: read and check the body, take a
slot, start the request on the fleet, and answer with JSON or SSE.

A stream's status waits for the worker's first event (an `openai` or `vllm-grpc`
upstream's: at most `HEAD_GRACE`, 5 ms, once the engine took the request, for a refusal
it streams; `gateway.upstreams.base`), so refusals arrive as real
4xx/5xx; after that an error is one SSE error payload and `[DONE]`. A client
that goes away cancels the worker's call at once, one that stops reading does
after `write_timeout` (see write_guard.py), and the slot comes back on every
path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, Protocol, TypeVar

from gateway.admission import EventPump
from gateway.admission.admit import RequestContext
from gateway.edge.asgi import WRITE_NOW_EXTENSION, Send, send_json
from gateway.edge.compacting import Compacting, compaction_start
from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.turns import McpPlan, turns_start
from gateway.edge.openai.body import read_json
from gateway.edge.openai.encoding import KEEPALIVE, OBFUSCATED, Encoder
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.validation import ParsedRequest, model_of
from gateway.edge.request import Exchange, Parts, RequestRoute, priority, session
from gateway.fleet import ModelPool
from gateway.protocol import errors, features
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.protocol.types import Event, GenerateRequest, Reasoning, Started, Text
from gateway.telemetry import RequestRecord
from gateway.telemetry.tracing import annotate
from gateway.upstreams.base import UpstreamCall

log = logging.getLogger("furnace.edge")

_T = TypeVar("_T")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def check_features(pool: ModelPool, request: GenerateRequest) -> None:
    """Refuses, naming the parameter, what the model's workers do not serve; when
    none has described itself yet, the worker refuses for itself (but a sound or a
    video, which only an OpenAI-compatible server would see)."""
    served = pool.features()
    if served is None:
        check_relayed_media(pool, request)
        return
    if features.GENERATE not in served:
        raise invalid(
            "model", f"The model `{pool.name}` does not generate text; it serves /v1/embeddings."
        )
    lacking = features.missing(request, served)
    if lacking is not None:
        feature, param = lacking
        raise invalid(param, f"The model `{pool.name}` does not support '{feature}'.")


def echoed(request: GenerateRequest) -> str | None:
    """What an answer that echoes starts with: a completion's prompt; a chat's last
    message where it is the answer's role, an assistant's (vLLM's chat `echo`: with
    `continue_final_message`, the whole message the answer completes); else nothing."""
    messages = request.messages
    if messages is None:
        return request.prompt
    last = messages[-1] if messages else None
    return last.content if last is not None and last.role == "assistant" else None


def check_relayed_media(pool: ModelPool, request: GenerateRequest) -> None:
    """Refuses a sound or a video (`input_audio`, `audio_url`, `video_url` parts) for a
    model not on OpenAI-compatible servers, described or not: neither the worker protocol
    nor vLLM's gRPC server has a field for one, so it would be dropped on the way."""
    if not pool.relays_answers and request.messages is not None:
        media = features.relayed_media(request)
        if media is not None:
            feature, part = media
            raise invalid(part, f"The model `{pool.name}` does not support '{feature}'.")


def _check_usage(parsed: ParsedRequest, pool: ModelPool) -> None:
    """Refuses per-chunk usage (`continuous_usage_stats`) for a model on OpenAI-compatible
    servers, whose prompt's tokens come only with their last chunk."""
    if parsed.continuous_usage and pool.relays_answers:
        raise invalid(
            "stream_options.continuous_usage_stats",
            f"The model `{pool.name}` is served by OpenAI-compatible servers, which count "
            "the prompt's tokens only at the end of the answer: per-chunk usage is not "
            "available for it.",
        )


def _user(body: Any) -> str | None:
    """The body's session key for an alias's draw, as routing reads it: its
    `prompt_cache_key` (chat's and the Responses API's), else its `user`, when a string."""
    if not isinstance(body, dict):
        return None
    key = body.get("prompt_cache_key") or body.get("user")
    return key if isinstance(key, str) and key else None


def served(ctx: RequestContext, pool: ModelPool) -> ModelPool:
    """The pool that serves: a fallback's, when admission moved the request to one."""
    return ctx.pool or pool


async def _ready(started: _T) -> _T:
    """A start already done, for the pump."""
    return started


class GenerationRoute(RequestRoute[Exchange]):
    """/v1/chat/completions or /v1/completions, by its parser and encoder, in the edge's
    request frame (request.py). Another API's route (Responses, Messages) gives `params`:
    chat's parameter names, as the checks it shares with chat (the model's features, the
    limits, the worker) name them, to its own, which its refusals name instead."""

    exchange = Exchange

    def __init__(
        self,
        parse: Callable[[Any, str], ParsedRequest],
        encoder_type: type[Encoder],
        parts: Parts,
        limits: InputLimits,
        params: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(parts)
        self.parse = parse
        self.encoder_type = encoder_type
        self.limits = limits
        self.params = params or {}

    def _usage(self, record: RequestRecord) -> dict[str, Any]:
        # OTel GenAI semantic conventions: the cache's reads are a share of the input
        return {
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }

    async def _refuse(self, ex: Exchange, error: APIError) -> None:
        """The refusal, naming this API's parameter where a shared check named chat's
        (its leading name: `messages[2].content` is `input`'s on the Responses API)."""
        param = error.param
        if param and self.params:
            ours = self.params.get(param.split("[", 1)[0].split(".", 1)[0])
            if ours is not None:
                error.message = error.message.replace(f"'{param}'", f"'{ours}'")
                error.param = ours
        await super()._refuse(ex, error)

    async def parse_body(self, body: Any, ex: Exchange) -> ParsedRequest:
        """The body as our request; a route whose parsing needs more than the body (the
        Responses API's stored conversation) overrides it."""
        return self.parse(body, ex.record.request_id)

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> Encoder:
        """The answer's encoder; a route whose answer repeats its request overrides it."""
        generate = parsed.generate
        # a stream that asks for padding has an encoder of its own: one that does not
        # runs none of it
        return (OBFUSCATED[self.encoder_type] if parsed.obfuscate else self.encoder_type)(
            pool.name,
            parsed.include_usage,
            choices=generate.n,
            logprobs=generate.logprobs is not None,
            tools=bool(generate.tools),
            echo=echoed(generate) if parsed.echo else None,
            # an upstream that builds its own answer already chose its finish reason
            named_tool=not pool.relays_answers
            and generate.tool_choice not in ("", "none", "auto", "required"),
            continuous_usage=parsed.continuous_usage,
            reasoning=parsed.show_reasoning,
            token_ids=generate.return_token_ids,
        )

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the body, admits it through admission's stages (a queued
        client that leaves, leaves the queue at once) and serves it."""
        parsed, pool = await self.prepare(ex)
        ex.watch_client()  # from here: a queued client that goes away leaves the queue
        async with self.admission.admit(ex.ctx):
            await self._serve(parsed, served(ex.ctx, pool), ex)

    async def prepare(self, ex: Exchange) -> tuple[ParsedRequest, ModelPool]:
        """Everything before admission: the body read, parsed and checked against the
        model's features and the input limits (a route that detaches its admission, as
        the Responses API's background mode, takes it from here)."""
        ctx, record = ex.ctx, ex.record
        admission = self.admission
        meter = admission.before_body(ctx)
        body = await read_json(ex.scope, ex.receive, self.config.max_body_bytes, meter)
        ctx.fallbacks = True  # it serves on `ctx.pool`, which a fallback may change
        if admission.aliases.every:  # an alias's draw keeps a session on one target
            ctx.session = session(ex) or _user(body)
        pool = admission.visibility(ctx, model_of(body))
        parsed = await self.parse_body(body, ex)
        header = session(ex)
        if header and not parsed.generate.session:  # a route's own key comes first
            parsed = replace(parsed, generate=replace(parsed.generate, session=header))
        record.stream = parsed.stream
        if self.telemetry.log_prompts:
            generate = parsed.generate
            record.prompt = generate.prompt if generate.messages is None else generate.messages
        check_features(pool, parsed.generate)
        _check_usage(parsed, pool)
        parsed = self.limits.check(parsed, pool.name, pool.max_context)
        ctx.request = parsed.generate
        ctx.priority = priority(ex)
        return parsed, pool

    async def _serve(self, parsed: ParsedRequest, pool: ModelPool, ex: Exchange) -> None:
        config = self.config
        request = parsed.generate  # parsed with the request's id
        if request.model != pool.name:  # the body named none: the team's first
            request = replace(request, model=pool.name)
        granted = ex.record.granted_tokens
        if (
            granted is not None
            and request.sampling.max_tokens is None
            and (pool.max_context is None or granted < pool.max_context)
        ):
            # no bound of its own: its team's token limit granted it this many (where the
            # model's context is no larger, the context already bounds the answer below it)
            sampling = replace(request.sampling, max_tokens=granted)
            request = replace(request, sampling=sampling)
        timeout = config.stream_timeout if parsed.stream else config.request_timeout
        deadline = Deadline(timeout)
        with self.tracing.engine_call(pool.name, ex.metadata) as (span, metadata):
            if self.admission.falls_back(ex.ctx):
                # started before the answer's encoder is made: it names the model that
                # serves, which a fallback decides by the first event
                start = self.admission.start(ex.ctx, request, deadline, metadata)
                started = await self.admission.unary(ex.ctx, start, None, "The start")
                pool = served(ex.ctx, pool)
                start = _ready(started)
            else:
                start = self.fleet.start_call(pool, request, deadline, metadata, ex.record)
            if parsed.turns:  # an answer of several turns (the Responses API's MCP tools)
                start = self.turns(parsed, request, start, pool, deadline, metadata, ex)
            pump = EventPump(start, config.stream_buffer_bytes, request.n)
            if parsed.stream_interval > 1:
                pump.interval = parsed.stream_interval
            try:
                await self._relay(pump, parsed, pool, ex)
            finally:
                if span is not None:
                    record = ex.record
                    annotate(
                        span,
                        {
                            "furnace.worker": record.worker or None,
                            "furnace.route.policy": record.policy or None,
                            "furnace.route.cache_hit_blocks": record.cache_hit_blocks,
                            "furnace.prefill_worker": record.prefill_worker or None,
                            "furnace.prefill.cache_hit_blocks": record.prefill_cache_hit_blocks,
                        },
                    )

    def turns(
        self,
        parsed: ParsedRequest,
        request: GenerateRequest,
        start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
        pool: ModelPool,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
        ex: Exchange,
    ) -> Coroutine[Any, Any, tuple[Started, UpstreamCall]]:
        """The start of an answer of turns (`parsed.turns`) from its first turn's `start`:
        around its MCP servers' calls (its `plan`, which the route made: gateway/edge/mcp),
        or a compacting answer's (gateway/edge/compacting.py); the next turns on the pool
        that serves (a fallback's, where admission moved the request), as the first was
        started."""

        def start_turn(turn: GenerateRequest) -> Awaitable[tuple[Started, UpstreamCall]]:
            return self.fleet.start_call(served(ex.ctx, pool), turn, deadline, metadata, ex.record)

        if isinstance(parsed, Compacting):  # the summary's turn first (its `generate`)
            assert parsed.asked is not None
            goes_on, asked = parsed.continuation(), parsed.asked
            record = partial(self.telemetry.metrics.compaction, served(ex.ctx, pool).name)
            return compaction_start(request, asked, goes_on, start, start_turn, deadline, record)
        plan = getattr(parsed, "plan", None)
        assert isinstance(plan, McpPlan)
        started = self.admission.falls_back(ex.ctx)
        timeout = self.config.mcp_timeout
        return turns_start(plan, request, start, start_turn, started, deadline, timeout)

    async def _relay(
        self, pump: EventPump, parsed: ParsedRequest, pool: ModelPool, ex: Exchange
    ) -> None:
        record, gone = ex.record, ex.ctx.gone
        assert gone is not None
        gone.add_done_callback(lambda _: pump.cancel())
        try:
            _check_usage(parsed, pool)  # the pool that serves: a fallback's, maybe
            record.expect(parsed.generate.n)
            with self.inflight.track(pump):
                # the call is written first: the answer's encoder is built while the
                # engine works, off the first token's way
                await pump.start(self.config.request_timeout)
                encoder = self.encoder(parsed, pool)
                write_now = ex.scope.get("extensions", {}).get(WRITE_NOW_EXTENSION)
                await self._relay_events(
                    pump, encoder, parsed.stream, record, ex.send, gone, write_now
                )
        finally:
            record.worker = pump.worker
            await pump.aclose()

    async def _relay_events(
        self,
        pump: EventPump,
        encoder: Encoder,
        stream: bool,
        record: RequestRecord,
        send: Send,
        gone: asyncio.Future[None],
        write_now: WriteNow | None = None,
    ) -> None:
        if stream:
            await self._stream(pump, encoder, record, send, gone, write_now)
        else:
            await self._answer(pump, encoder, record, send)

    async def _answer(
        self, pump: EventPump, encoder: Encoder, record: RequestRecord, send: Send
    ) -> None:
        timeout = self.config.request_timeout
        plain = encoder.plain
        texts: list[str] = []
        thoughts: list[Reasoning] = []
        try:
            async with asyncio.timeout(timeout):
                while record.finished is None:
                    batch = await pump.next_batch(timeout)
                    if plain:
                        texts.append(record.take(batch))
                        if Reasoning in map(type, batch):
                            thoughts += [e for e in batch if type(e) is Reasoning]
                    else:
                        record.take(batch)
                        encoder.add(batch)
        except TimeoutError:
            raise errors.Timeout(f"The answer took longer than {timeout:g} seconds.") from None
        if plain:
            reason = record.finished.reason
            body = encoder.response(
                "".join(texts),
                reason,
                record.prompt_tokens,
                record.completion_tokens,
                thoughts,
                record.cached_tokens,
            )
        else:
            body = encoder.answer(
                record.prompt_tokens, record.completion_tokens, record.cached_tokens
            )
        record.status, record.outcome = 200, Outcome.COMPLETED
        served = (b"x-furnace-model", record.model.encode("latin-1"))
        request_id = (b"x-request-id", record.request_id.encode("latin-1"))
        await send_json(send, 200, body, [request_id, served])

    async def _stream(
        self,
        pump: EventPump,
        encoder: Encoder,
        record: RequestRecord,
        send: Send,
        gone: asyncio.Future[None],
        write_now: WriteNow | None = None,
    ) -> None:
        """Writes each batch as it comes: the one-choice path joins its text
        into one delta; the others write `encoder.events`. Ends after the last
        choice's `Finished`. Once the head is out, the one-choice path's texts,
        the first one and its opening too, may be written by the pump's sink
        instead (`_Sink`)."""
        config = self.config
        batch = await pump.next_batch(config.request_timeout)
        request_id = record.request_id.encode("latin-1")
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    *_SSE_HEADERS,
                    (b"x-request-id", request_id),
                    (b"x-furnace-model", record.model.encode("latin-1")),
                ],
            }
        )
        record.status = 200
        plain = encoder.plain
        # The role-opening chunk goes out with the first text (or the end), as
        # vLLM's server sends it: the first token costs one write, not two.
        held = _Sink(record, encoder, write_now, encoder.opening() if plain else b"")
        body = b""
        while True:
            if plain:
                text = record.take(batch)
                if Reasoning in map(type, batch):  # a reasoning model's: in the batch's order
                    body += held.opening + encoder.deltas(batch)
                    held.opening = b""
                elif text:
                    body += held.opening + encoder.delta(text)
                    held.opening = b""
            else:
                record.take(batch)
                body += encoder.events(batch)
            if record.finished is not None:
                break
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            if plain and write_now is not None and pump.sink is None:
                # from here a text that comes while this task waits is written in the
                # callback that brought it, the first one too (with its opening)
                pump.sink = held
            try:
                batch = await pump.next_batch(config.request_timeout, config.keepalive_interval)
            except errors.GatewayError as error:
                if gone.done():
                    raise
                api_error = self._to_api_error(error, record)
                record.outcome = api_error.outcome
                # a held opening goes first: the failure may close what it opened
                failure = held.opening + encoder.failure(api_error)
                await send({"type": "http.response.body", "body": failure})
                return
            body = b"" if batch else KEEPALIVE
        prompt_tokens, completion_tokens = record.prompt_tokens, record.completion_tokens
        cached_tokens = record.cached_tokens
        if plain:
            reason = record.finished.reason
            closing = encoder.closing(reason, prompt_tokens, completion_tokens, cached_tokens)
            body += held.opening + closing
        else:
            body += encoder.end(prompt_tokens, completion_tokens, cached_tokens)
        record.outcome = Outcome.COMPLETED
        await send({"type": "http.response.body", "body": body})


class WriteNow(Protocol):
    """`WRITE_NOW_EXTENSION`'s object: a body chunk written at once, if it can be."""

    def writable(self) -> bool:
        """Whether a chunk would be written now."""
        ...

    def write(self, body: bytes) -> None:
        """Writes `body`, once `writable` said it would be, in the same callback."""
        ...


class _Sink:
    """The pump's sink of a one-choice stream whose head is out: a batch of texts
    (and a reasoning model's reasoning) alone, written in the callback that brought it,
    as `_stream`'s loop would write it (the first after the role's `opening`, which this
    holds until then, for the loop too); False for any other batch (an end, an error),
    or while the connection cannot take a write at once (the loop writes it then, under
    the write guard), asked before anything is encoded: an encoder may count what it
    encodes. The first token so skips the wake of the request's task and its chain of
    coroutines, as every later one does."""

    __slots__ = ("delta", "encoder", "opening", "record", "writable", "write")

    def __init__(
        self, record: RequestRecord, encoder: Encoder, write_now: WriteNow | None, opening: bytes
    ) -> None:
        self.record = record
        self.encoder = encoder
        self.delta = encoder.delta
        self.opening = opening
        # installed as the pump's sink only with one; the loop's holder of `opening` else
        self.writable = _never if write_now is None else write_now.writable
        self.write = _nowhere if write_now is None else write_now.write

    def __call__(self, batch: list[Event]) -> bool:
        if len(batch) == 1:  # the usual: a read brings a token
            event = batch[0]
            if type(event) is not Text:
                return type(event) is Reasoning and self._thoughts(batch)
            text = event.text
        else:
            pieces = []
            for event in batch:
                if type(event) is not Text:
                    return self._thoughts(batch)
                pieces.append(event.text)
            text = "".join(pieces)
        if text:
            if not self.writable():
                return False
            self.write(self.opening + self.delta(text))
            self.opening = b""
        self.record.take_texts(batch)
        return True

    def _thoughts(self, batch: list[Event]) -> bool:
        """A batch of texts and reasoning, in its order; False for any other."""
        if not all(type(event) is Text or type(event) is Reasoning for event in batch):
            return False
        if not self.writable():
            return False
        chunks = self.encoder.deltas(batch)
        if chunks:
            self.write(self.opening + chunks)
            self.opening = b""
        self.record.take_texts(batch)
        return True


def _never() -> bool:
    return False


def _nowhere(body: bytes) -> None:
    raise AssertionError("written without a connection to write to")
