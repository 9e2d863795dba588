"""The gRPC Engine service over any `Engine`.

The engine's generators run in tasks of their own and fill one buffer; the RPC
sends what the buffer holds whenever the stream can take a message, one `Text`
per choice per send, so an engine that runs ahead of the network costs one
message per send, not one per token. Cancellation of the call (by the client or
its deadline) cancels those tasks, which closes the engine's generators.

A request is checked against what the engine lists (`Engine.features`) before
the engine sees it: a feature it does not list is INVALID_ARGUMENT naming the
parameter, so nothing is silently ignored.

n choices: unless the engine does n itself (`Engine.native_n`), the SDK runs n
generations of the request with n=1 (seed + i for choice i when a seed is set)
at once and merges their events: one `Started` (choice 0's prompt tokens) once
every choice has started, so a refusal of any is still a status before it; each
choice's events carry its index; the call ends after every choice's `Finished`;
one failure fails the call, and cancelling it stops them all.

Stop strings are matched per choice. Logprobs follow the text: a token's logprob
goes out in the `Text` that releases the end of its text (at once, without stop
strings); when a stop string cuts the answer, the tokens whose text starts
before the cut keep theirs and the rest (wholly inside the stop string) are
dropped. `Text.tokens` still counts every generated token, as usage does, and
with `return_token_ids` (which engines list) a `Text` carries the ids of the tokens it
counts, those of text a stop string cut too (`_IdsChoice`, a request's own choices, so
the others' token path reads no ids).

Tokenize and Detokenize (vLLM's /tokenize and /detokenize) reach an engine that lists
"tokenize" only (else INVALID_ARGUMENT naming `model`, as CountTokens from an engine
that cannot count); the SDK bounds the ids a client sends and the reply
(`gateway.worker.engine`'s `MAX_DETOKENIZE_IDS`, `MAX_DETOKENIZED_CHARS`,
`MAX_TOKENIZE_REPLY`).

LoRA adapters (`Engine.takes_adapters`): `Describe` lists each beside the model (its
`parent`), a request naming one reaches the engine as any other (the engine runs it
with the adapter), and `LoadAdapter` checks the name and path (`check_adapter`) and
runs one engine load per adapter at a time, which every call asking for it meanwhile
waits on (two gateways' first requests load it once), and which a caller leaving
does not cancel (another is likely to ask again).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar, cast

import grpc

from gateway.protocol import errors, features
from gateway.protocol.convert import (
    embed_request_from_proto,
    embeddings_to_proto,
    event_to_proto,
    event_with_ids_to_proto,
    request_from_proto,
)
from gateway.protocol.kv_proto import batch_to_proto
from gateway.protocol.sizes import event_size
from gateway.protocol.status import status_from_error
from gateway.protocol.stop import StopMatcher
from gateway.protocol.types import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Reasoning,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker.engine import (
    MAX_DETOKENIZE_IDS,
    MAX_DETOKENIZED_CHARS,
    MAX_TOKENIZE_REPLY,
    Engine,
    check_adapter,
)
from gateway.worker.kv_events import SubscriberTooSlow
from gateway.worker.multiplex import Multiplexer

log = logging.getLogger("furnace.worker")
#: A unary reply.
T = TypeVar("T")

#: What an engine may run ahead of the RPC (`event_size`: text, logprobs and tool-call
#: arguments; also about the largest `Text`).
READ_AHEAD_CHARS = 64 * 1024
#: The most choices one request may ask for (OpenAI's bound).
MAX_N = 128
#: The most alternatives per token one request may ask for (OpenAI's bound).
MAX_LOGPROBS = 20


class _ReadAhead:
    """Runs an engine's generators (one per choice, or one for all) in tasks;
    hands out what is ready as lists, starting with one `Started` once each
    has started. Events of generator i > 0 are re-indexed to choice i.

    It reads ahead at most `READ_AHEAD_CHARS` (`event_size`: logprobs counted): past
    that it waits for the RPC to take a batch, so a gateway that stops reading (HTTP/2
    flow control holds the RPC's sends) stops the engine too, and no message grows
    past it."""

    def __init__(self, sources: list[AsyncIterator[Event]], finishes: int) -> None:
        self._sources = sources
        self._ready: list[Event] = []
        self._buffered = 0  # `event_size` of what `_ready` holds
        self._error: BaseException | None = None
        self._live = len(sources)
        self._starts = 0
        self._open = False  # every generator has started: batches may go out
        self._first: Started | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(i, source, finishes)) for i, source in enumerate(sources)
        ]

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start(self, source: int, event: Started) -> None:
        if source == 0:
            self._first = event
        self._starts += 1
        if self._starts == len(self._sources):
            assert self._first is not None
            self._ready.insert(0, self._first)
            self._open = True
            self._wake()

    async def _run(self, source: int, events: AsyncIterator[Event], finishes: int) -> None:
        """Reads one generator until its `finishes` Finished events."""
        started = False
        try:
            async for event in events:
                # the token path: `type() is` tests (cast() and isinstance cost calls)
                kind = type(event)
                if kind is Started:
                    if started:
                        raise errors.Failed("The engine sent Started twice.")
                    started = True
                    self._start(source, cast(Started, event))
                    continue
                if not started:
                    raise errors.Failed("The engine did not start the answer with Started.")
                if source and (
                    kind is Text or kind is ToolCallDelta or kind is Reasoning or kind is Finished
                ):
                    event = cast(Text, event)._replace(index=source)
                self._ready.append(event)
                waiter = self._waiter
                if waiter is not None and self._open and not waiter.done():
                    waiter.set_result(None)
                if kind is not Finished:
                    self._buffered += event_size(event)
                else:
                    finishes -= 1
                    if not finishes:
                        return
                    continue
                if self._buffered >= READ_AHEAD_CHARS:
                    room = self._room
                    if room is None or room.done():
                        room = self._room = asyncio.get_running_loop().create_future()
                    await room
            if not started:
                raise errors.Failed("The engine did not start the answer with Started.")
        except Exception as error:
            if self._error is None:
                self._error = error
        finally:
            self._live -= 1
            self._wake()

    async def batch(self) -> list[Event]:
        """The events ready now (at least one), [] at the end; raises the engine's error."""
        loop = asyncio.get_running_loop()
        while not (self._ready and self._open):
            if self._live == 0 or self._error is not None:
                if self._error is not None:
                    raise self._error
                return []
            self._waiter = loop.create_future()
            await self._waiter
            self._waiter = None
        batch, self._ready, self._buffered = self._ready, [], 0
        room = self._room
        if room is not None and not room.done():
            room.set_result(None)
        return batch

    async def stop(self, source: int) -> None:
        """Stops one generator (its choice ended) and waits until it has."""
        task = self._tasks[source]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self._sources[source].aclose()  # type: ignore[attr-defined]

    async def aclose(self) -> None:
        """Stops the engine (its generators are closed) and waits until it has."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for source in self._sources:
            await source.aclose()  # type: ignore[attr-defined]


class _Choice:
    """One choice's state on its way out: the stop strings, the text released
    and not yet sent, the tokens counted, and the logprobs that go with them."""

    __slots__ = (
        "dirty",
        "done",
        "fed",
        "holds",
        "index",
        "logprobs",
        "pending",
        "pieces",
        "released",
        "stop",
        "tokens",
        "unsent",
    )

    def __init__(self, index: int, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self.index = index
        self.stop = StopMatcher(stops, include_stop)
        self.holds = any(stops)  # text may be held back: logprobs wait for it
        self.tokens = 0  # generated so far
        self.unsent = 0  # of those, not yet in a sent Text
        self.pieces: list[str] = []
        self.dirty = False  # has pieces or logprobs to send
        self.done = False
        self.logprobs: list[TokenLogprob] | None = None  # to send with the next Text
        #: With stop strings: (start, end, logprob) of tokens whose text is not all out.
        self.pending: deque[tuple[int, int, TokenLogprob]] = deque()
        self.fed = 0  # characters of text fed to the matcher
        self.released = 0  # of those, released

    def text(self, event: Text) -> bool:
        """Takes a piece of text; True when a stop string ended the answer."""
        self.tokens += event.tokens
        self.unsent += event.tokens
        released, stopped = self.stop.feed(event.text)
        if released:
            self.pieces.append(released)
        if self.holds:
            start = self.fed
            self.fed += len(event.text)
            self.released += len(released)
            if event.logprobs is not None:
                self._hold(event.logprobs, start, self.fed)
                self._release(stopped)
        elif event.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(event.logprobs)
        return stopped

    def _hold(self, logprobs: tuple[TokenLogprob, ...], start: int, end: int) -> None:
        """Places each token's text in the choice's text (the last ends the piece)."""
        last = len(logprobs) - 1
        for i, logprob in enumerate(logprobs):
            stop = end if i == last else min(start + len(logprob.token), end)
            self.pending.append((start, stop, logprob))
            start = stop

    def _release(self, cut: bool) -> None:
        """Moves the logprobs of released text out; at a cut, those before it."""
        if self.logprobs is None:
            self.logprobs = []
        pending, released = self.pending, self.released
        while pending and (pending[0][1] <= released or (cut and pending[0][0] < released)):
            self.logprobs.append(pending.popleft()[2])
        if cut:
            pending.clear()

    def flush(self) -> None:
        """The answer (or its text, before a tool call) ended: release what is held."""
        held = self.stop.flush()
        if held:
            self.pieces.append(held)
            self.released += len(held)
            self.dirty = True
        if self.pending:
            self._release(cut=False)

    def take(self) -> Text | None:
        """The text (and logprobs) ready to send, as one `Text`; None if none."""
        self.dirty = False
        text = "".join(self.pieces)
        logprobs = self.logprobs
        if not text and not logprobs:
            return None
        self.pieces = []
        event = Text(text, self.unsent, self.index, None if logprobs is None else tuple(logprobs))
        self.unsent = 0
        if logprobs is not None:
            self.logprobs = []
        return event


class _IdsChoice(_Choice):
    """A choice of a request that asked for token ids (`return_token_ids`): its `Text`
    carries the ids of the tokens it counts, those of text a stop string cut or holds
    back too (so the choice's ids joined are all it generated). A class of its own: the
    other requests' token path reads no ids."""

    __slots__ = ("ids",)

    def __init__(self, index: int, stops: tuple[str, ...], include_stop: bool = False) -> None:
        super().__init__(index, stops, include_stop)
        self.ids: list[int] = []  # of the tokens not yet in a sent Text

    def text(self, event: Text) -> bool:
        if event.token_ids:
            self.ids.extend(event.token_ids)
        return super().text(event)

    def take(self) -> Text | None:
        ids = self.ids
        if not ids:
            return super().take()
        self.ids = []
        event = super().take()
        if event is None:  # no text: a stop string's tokens, say
            event = Text("", self.unsent, self.index, None, tuple(ids))
            self.unsent = 0
            return event
        return event._replace(token_ids=tuple(ids))


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], error: errors.GatewayError
) -> NoReturn:
    """Ends the call with the error's status (and its parameter, for INVALID_ARGUMENT)."""
    code, trailing = status_from_error(error)
    context.set_trailing_metadata(trailing)
    await context.abort(code, error.message)


async def _answered(
    context: grpc.aio.ServicerContext[Any, Any], work: Awaitable[T], what: str, request_id: str
) -> T:
    """`work`'s reply to a unary call; a `GatewayError` ends the call with its status,
    anything else is logged (the engine failing to do `what` for `request_id`) and ends
    it as the engine's failure."""
    try:
        return await work
    except errors.GatewayError as error:
        await _abort(context, error)
    except Exception:
        log.exception("engine failed to %s request %s", what, request_id)
        await _abort(context, errors.Failed("The engine failed."))


class EngineService(pb_grpc.EngineServicer):
    """Serves one engine over the worker protocol."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = 0
        #: The worker is stopping (`drain`): new requests are refused UNAVAILABLE
        #: (another worker takes them), as the server refuses new calls.
        self.draining = False
        self._multiplexed: set[Multiplexer] = set()
        self._subscriptions: set[asyncio.Task[Any]] = set()  # SubscribeKvEvents calls
        #: Adapter loads under way, by (name, path): LoadAdapter calls share them.
        self._adapter_loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        served = engine.features
        #: What the worker serves, as `Describe` lists it: the SDK does n and the stop
        #: strings itself.
        sdk = {features.N, features.INCLUDE_STOP}
        self.features = served | sdk if features.GENERATE in served else served

    def _serves(self, model: str) -> bool:
        """Whether a request may name `model` here: the engine's model (or none), or an
        adapter of it the engine serves."""
        engine = self.engine
        return not model or model == engine.model or model in engine.adapters()

    def _refusal(self, request: GenerateRequest) -> errors.Invalid | None:
        """Why the request cannot be served here, before the engine sees it."""
        model = self.engine.model
        if features.GENERATE not in self.features:
            return errors.Invalid(f"The model `{model}` does not generate text.", param="model")
        unserved = features.missing(request, self.features)
        if unserved is not None:
            feature, param = unserved
            return errors.Invalid(f"The model `{model}` does not take `{feature}`.", param=param)
        if request.n > MAX_N:
            return errors.Invalid(f"`n` must be at most {MAX_N}.", param="n")
        if request.logprobs is not None and request.logprobs > MAX_LOGPROBS:
            return errors.Invalid(f"At most {MAX_LOGPROBS} logprobs a token.", param="logprobs")
        return None

    def _read_ahead(self, request: GenerateRequest) -> _ReadAhead:
        """The engine's generators for the request: one, or one per choice."""
        engine = self.engine
        if engine.native_n or request.n == 1:
            return _ReadAhead([engine.generate(request)], request.n)
        sampling, seed = request.sampling, request.sampling.seed
        choices = []
        for i in range(request.n):
            if seed is not None:
                sampling = dataclasses.replace(sampling, seed=seed + i)
            choices.append(engine.generate(dataclasses.replace(request, n=1, sampling=sampling)))
        return _ReadAhead(choices, 1)

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateEvent],
    ) -> AsyncIterator[pb.GenerateEvent]:
        """One answer (n choices); see engine.proto for the contract."""
        try:
            async with contextlib.aclosing(self.answer(request)) as events:
                async for event in events:
                    yield event
        except errors.GatewayError as error:
            await _abort(context, error)
        except asyncio.CancelledError:
            log.debug("request %s cancelled", request.request_id)
            raise
        except Exception:
            log.exception("engine failed on request %s", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "The engine failed.")

    async def GenerateMultiplexed(
        self,
        requests: AsyncIterator[pb.MultiplexRequest],
        context: grpc.aio.ServicerContext[pb.MultiplexRequest, pb.MultiplexResponse],
    ) -> None:
        """Many answers on one call (see gateway.worker.multiplex), each as Generate's."""
        call = Multiplexer(self._started, context)
        self._multiplexed.add(call)
        if self.draining:
            call.close_when_idle()
        try:
            await call.serve(requests)
        finally:
            self._multiplexed.discard(call)

    def drain(self) -> None:
        """The worker stops: new requests are refused, and each multiplexed call
        ends once its open requests have (a stopping server waits for its calls);
        KV-event subscriptions end at once."""
        self.draining = True
        for call in self._multiplexed:
            call.close_when_idle()
        for task in self._subscriptions:
            task.cancel()

    async def SubscribeKvEvents(
        self,
        request: pb.KvEventsRequest,
        context: grpc.aio.ServicerContext[pb.KvEventsRequest, pb.KvEventBatch],
    ) -> AsyncGenerator[pb.KvEventBatch, None]:
        """The engine's KV-cache events (`Engine.kv_events`): a reset snapshot, then the
        live batches; UNIMPLEMENTED from an engine without them."""
        engine = self.engine
        if request.model and request.model != engine.model:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"This worker does not serve `{request.model}`."
            )
        publisher = engine.kv_events()
        if publisher is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "This worker has no KV events.")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "The worker is stopping.")
        task = asyncio.current_task()
        assert task is not None
        self._subscriptions.add(task)
        try:
            async for batch in publisher.subscribe():
                yield batch_to_proto(batch)
        except SubscriberTooSlow as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV events: {error}")
        finally:
            self._subscriptions.discard(task)

    def _started(self, start: pb.MultiplexStart) -> AsyncGenerator[pb.GenerateEvent, None]:
        return self.answer(start.request)

    async def answer(self, request: pb.GenerateRequest) -> AsyncGenerator[pb.GenerateEvent, None]:
        """One answer, whichever call carries it; a refusal or a failure is
        raised as a `GatewayError`."""
        engine = self.engine
        if not self._serves(request.model):
            raise errors.ModelNotFound(f"This worker does not serve `{request.model}`.")
        ours = request_from_proto(request)
        refusal = self._refusal(ours)
        if refusal is not None:
            raise refusal
        if self.draining:
            raise errors.Unavailable("The worker is shutting down.")
        # each of the n choices is an answer the engine runs: n count against capacity
        if ours.n > engine.capacity:
            raise errors.Invalid(f"`n` must be at most {engine.capacity} here.", param="n")
        if self.active + ours.n > engine.capacity:
            raise errors.Busy("The worker is full.")
        self.active += ours.n
        events = self._read_ahead(ours)
        kind, convert = (
            (_IdsChoice, event_with_ids_to_proto)
            if ours.return_token_ids
            else (_Choice, event_to_proto)
        )
        choices = [kind(i, ours.stop, ours.include_stop) for i in range(ours.n)]
        fan_out = not engine.native_n and ours.n > 1
        try:
            async for event in self._messages(events, choices, fan_out, convert):
                yield event
        finally:
            self.active -= ours.n
            await events.aclose()

    async def _messages(
        self,
        events: _ReadAhead,
        choices: list[_Choice],
        fan_out: bool,
        convert: Callable[[Event], pb.GenerateEvent] = event_to_proto,
    ) -> AsyncIterator[pb.GenerateEvent]:
        n = left = len(choices)
        while batch := await events.batch():
            out: list[Event] = []
            dirty: list[_Choice] = []
            for event in batch:
                kind = type(event)  # `type() is` tests: this runs once a token
                if kind is Started:  # the one Started, first of the first batch
                    out.append(event)
                    continue
                if (
                    kind is not Text
                    and kind is not ToolCallDelta
                    and kind is not Finished
                    and kind is not Reasoning
                ):
                    raise errors.Failed(f"The engine sent {kind.__name__} out of order.")
                index: int = event.index  # type: ignore[assignment]
                if index >= n or index < 0:
                    raise errors.Failed(f"The engine sent choice {index} of {n}.")
                choice = choices[index]
                if choice.done:  # it ended at a stop string; the engine ran on
                    continue
                if kind is Text:
                    if not choice.dirty:
                        choice.dirty = True
                        dirty.append(choice)
                    if not choice.text(event):  # type: ignore[arg-type]
                        continue
                    stop = choice.stop.matched
                    event = Finished(FinishReason.STOP, choice.tokens, None, index, stop)
                elif kind is Reasoning:
                    # beside the text, not in it: no stop string applies; what text is
                    # released goes first, so the order the engine gave is kept
                    choice.tokens += event.tokens  # type: ignore[union-attr]
                    if choice.dirty:
                        text = choice.take()
                        if text is not None:
                            out.append(text)
                    out.append(event)
                    continue
                elif kind is ToolCallDelta:
                    choice.tokens += event.tokens  # type: ignore[union-attr]
                choice.flush()
                text = choice.take()
                if text is not None:
                    out.append(text)
                out.append(event)
                if kind is not ToolCallDelta:
                    choice.done = True
                    left -= 1
                    if fan_out and left:
                        await events.stop(index)  # only this choice's generation
            for choice in dirty:
                if choice.dirty:
                    text = choice.take()
                    if text is not None:
                        out.append(text)
            for event in out:
                yield convert(event)
            if not left:
                return
        raise errors.Failed("The engine ended the answer without Finished.")

    async def Describe(
        self,
        request: pb.DescribeRequest,
        context: grpc.aio.ServicerContext[pb.DescribeRequest, pb.DescribeResponse],
    ) -> pb.DescribeResponse:
        """The engine's model and its adapters (each with the model as `parent`), what
        they serve, capacity and load (by the engine's count where it keeps one)."""
        engine = self.engine
        load = engine.load()
        served = sorted(self.features)
        models = [pb.ModelInfo(name=engine.model, max_context=engine.max_context, features=served)]
        models += [
            pb.ModelInfo(
                name=name, max_context=engine.max_context, features=served, parent=engine.model
            )
            for name in sorted(engine.adapters())
        ]
        return pb.DescribeResponse(
            models=models,
            capacity=engine.capacity,
            load=self.active if load is None else load,
            multiplex=True,
        )

    def _embed_refusal(self, request: EmbedRequest) -> errors.Invalid | None:
        served, model = self.engine.features, self.engine.model
        if features.EMBEDDINGS not in served:
            return errors.Invalid(f"The model `{model}` does not serve embeddings.", param="model")
        if not request.inputs:
            return errors.Invalid("There is nothing to embed.", param="input")
        for feature, used in (
            (features.DIMENSIONS, request.dimensions is not None),
            (features.USER, bool(request.user)),
        ):
            if used and feature not in served:
                return errors.Invalid(
                    f"The model `{model}` does not take `{feature}`.", param=feature
                )
        return None

    async def Embed(
        self,
        request: pb.EmbedRequest,
        context: grpc.aio.ServicerContext[pb.EmbedRequest, pb.EmbedResponse],
    ) -> pb.EmbedResponse:
        """The inputs' vectors; refusals as for Generate."""
        engine = self.engine
        if not self._serves(request.model):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"This worker does not serve `{request.model}`."
            )
        ours = embed_request_from_proto(request)
        refusal = self._embed_refusal(ours)
        if refusal is not None:
            await _abort(context, refusal)
        if self.active >= engine.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "The worker is full.")
        self.active += 1
        result: Embeddings | errors.GatewayError
        try:
            result = await engine.embed(ours)
            if len(result.vectors) != len(ours.inputs):
                log.error(
                    "engine embedded %d inputs as %d vectors on request %s",
                    len(ours.inputs),
                    len(result.vectors),
                    request.request_id,
                )
                result = errors.Failed("The engine failed.")
        except errors.GatewayError as error:
            result = error
        except Exception:
            log.exception("engine failed on request %s", request.request_id)
            result = errors.Failed("The engine failed.")
        finally:
            self.active -= 1
        if isinstance(result, errors.GatewayError):
            await _abort(context, result)
        return embeddings_to_proto(result)

    async def CountTokens(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.CountTokensResponse],
    ) -> pb.CountTokensResponse:
        """The prompt's tokens by the engine's tokenizer; refusals as for Generate."""

        async def count() -> pb.CountTokensResponse:
            if not self._serves(request.model):
                raise errors.ModelNotFound(f"This worker does not serve `{request.model}`.")
            ours = request_from_proto(request)
            self._check_chat_end(ours)
            tokens = await self.engine.count_tokens(ours)
            return pb.CountTokensResponse(prompt_tokens=tokens)

        return await _answered(context, count(), "count", request.request_id)

    def _check_chat_end(self, request: GenerateRequest) -> None:
        """Refuses to count or tokenize a chat ended otherwise than the engine can end
        it (as Generate refuses it), not to count another prompt than it would make."""
        unserved = features.missing_chat_end(request, self.features)
        if unserved is not None:
            feature, param = unserved
            model = self.engine.model
            raise errors.Invalid(f"The model `{model}` does not take `{feature}`.", param=param)

    def _tokenizer_refusal(self, model: str) -> errors.GatewayError | None:
        """Why Tokenize or Detokenize naming `model` cannot be served here."""
        if not self._serves(model):
            return errors.ModelNotFound(f"This worker does not serve `{model}`.")
        if features.TOKENIZE not in self.engine.features:
            name = self.engine.model
            return errors.Invalid(f"The model `{name}` does not tokenize.", param="model")
        return None

    async def Tokenize(
        self,
        request: pb.TokenizeRequest,
        context: grpc.aio.ServicerContext[pb.TokenizeRequest, pb.TokenizeResponse],
    ) -> pb.TokenizeResponse:
        """The prompt's ids as CountTokens counts them (with each one's string when
        asked), from an engine that lists "tokenize"; refusals as for CountTokens, and a
        reply past one message (`MAX_TOKENIZE_REPLY`) refused naming the prompt."""
        prompt = request.prompt

        async def tokenize() -> pb.TokenizeResponse:
            refusal = self._tokenizer_refusal(prompt.model)
            if refusal is not None:
                raise refusal
            ours = request_from_proto(prompt)
            self._check_chat_end(ours)
            engine = self.engine
            ids = await engine.tokenize(ours)
            reply = pb.TokenizeResponse(ids=ids)
            if request.token_strs:
                strs = await engine.token_strs(ids)
                if len(strs) != len(ids):
                    log.error(
                        "engine gave %d strings for %d tokens on request %s",
                        len(strs),
                        len(ids),
                        prompt.request_id,
                    )
                    raise errors.Failed("The engine failed.")
                reply.token_strs.extend(strs)
            if reply.ByteSize() > MAX_TOKENIZE_REPLY:
                raise errors.Invalid(
                    f"The prompt's {len(ids)} tokens do not fit one reply "
                    f"({MAX_TOKENIZE_REPLY >> 20} MiB).",
                    param="messages" if ours.messages is not None else "prompt",
                )
            return reply

        return await _answered(context, tokenize(), "tokenize", prompt.request_id)

    async def Detokenize(
        self,
        request: pb.DetokenizeRequest,
        context: grpc.aio.ServicerContext[pb.DetokenizeRequest, pb.DetokenizeResponse],
    ) -> pb.DetokenizeResponse:
        """The text the ids decode to, special tokens kept, from an engine that lists
        "tokenize"; refusals as for CountTokens; more than `MAX_DETOKENIZE_IDS` ids, an id
        outside the vocabulary, or a text past `MAX_DETOKENIZED_CHARS`: INVALID_ARGUMENT
        naming "tokens"."""

        async def detokenize() -> pb.DetokenizeResponse:
            refusal = self._tokenizer_refusal(request.model)
            if refusal is not None:
                raise refusal
            if len(request.ids) > MAX_DETOKENIZE_IDS:
                raise errors.Invalid(
                    f"At most {MAX_DETOKENIZE_IDS} tokens to decode; got {len(request.ids)}.",
                    param="tokens",
                )
            text = await self.engine.detokenize(list(request.ids))
            if len(text) > MAX_DETOKENIZED_CHARS:
                raise errors.Invalid(
                    f"The tokens decode to more than {MAX_DETOKENIZED_CHARS} characters.",
                    param="tokens",
                )
            return pb.DetokenizeResponse(text=text)

        return await _answered(context, detokenize(), "detokenize", request.request_id)

    async def LoadAdapter(
        self,
        request: pb.LoadAdapterRequest,
        context: grpc.aio.ServicerContext[pb.LoadAdapterRequest, pb.LoadAdapterResponse],
    ) -> pb.LoadAdapterResponse:
        """Loads a LoRA adapter (see engine.proto for the statuses): a request out of
        bounds is INVALID_ARGUMENT; the engine's refusal (`Invalid`) of a well-formed one
        is FAILED_PRECONDITION, the operator's."""
        engine, name, path = self.engine, request.name, request.path
        if not engine.takes_adapters:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"The engine of this worker loads no LoRA adapters (it serves `{engine.model}`).",
            )
        try:
            check_adapter(name, path)
        except errors.Invalid as error:
            await _abort(context, error)
        if self.draining:
            await _abort(context, errors.Unavailable("The worker is shutting down."))
        if name == engine.model:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"`{name}` is this worker's model, not a name for an adapter of it.",
            )
        failure = await self._load_adapter(name, path)
        if isinstance(failure, errors.Invalid):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, failure.message)
        if failure is not None:
            await _abort(context, failure)
        return pb.LoadAdapterResponse()

    async def _load_adapter(self, name: str, path: str) -> errors.GatewayError | None:
        """The engine's load of the adapter, shared with every call asking for it
        meanwhile and not cancelled with this one: None once loaded, else why not."""
        key = (name, path)
        load = self._adapter_loads.get(key)
        if load is None:
            load = asyncio.get_running_loop().create_task(self.engine.load_adapter(name, path))
            self._adapter_loads[key] = load
            load.add_done_callback(lambda done: self._adapter_loaded(key, done))
        try:
            await asyncio.shield(load)
        except errors.GatewayError as error:
            return error
        except Exception:  # logged by `_adapter_loaded`
            return errors.Failed(f"The engine failed to load the adapter `{name}`.")
        return None

    def _adapter_loaded(self, key: tuple[str, str], load: asyncio.Task[None]) -> None:
        """A load ended: the next call asks the engine again (which knows what it
        holds); its failure is logged here, and so read even when no call waits."""
        self._adapter_loads.pop(key, None)
        failure = None if load.cancelled() else load.exception()
        if failure is None:
            log.info("adapter %s: loaded from %s", *key)
        elif isinstance(failure, errors.GatewayError):
            log.warning("adapter %s: not loaded from %s: %s", key[0], key[1], failure.message)
        else:
            log.error("engine failed to load the adapter %s from %s", *key, exc_info=failure)
