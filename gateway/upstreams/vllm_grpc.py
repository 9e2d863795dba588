"""vLLM's own gRPC server (`python -m vllm.entrypoints.grpc_server`, service
`vllm.grpc.engine.VllmEngine`, its proto from the `smg-grpc-proto` package) as a
worker: stock vLLM, no code of ours in the engine. It takes token ids and returns
token ids, so the gateway does what vLLM's own front end would:

- the chat template and tokenization (`gateway.tokenization`, the model's
  directory named by `tokenizer:`), then one streamed `Generate` per request;
- incremental detokenization as vLLM's (each answer's first token decoded after the
  prompt's last ids, as vLLM primes its detokenizer with the prompt; an answer that ends in a
  character's first bytes ends without them), stop strings (`StopMatcher`; the tokens
  counted up to the one that completed one, as vLLM's server counts them), the EOS ids from
  `GetModelInfo` as stop token ids; usage from the engine's counts;
- `GetModelInfo` for `describe`, `grpc.health.v1` and `HealthCheck` for health,
  `GetLoads` for the admin view;
- cancellation as the call's cancel plus an `Abort` of its request id;
- the OpenAI surface its proto has room for: n choices (`SamplingParams.n`, each
  chunk names its choice, each choice has its own detokenizer, stop strings and
  Finished), logprobs (the ids of `OutputLogProbs` and their alternatives decoded
  here), response_format and forced tool calls as the proto's JSON constraints
  (`gateway.protocol.tool_calls.required_schema`), tools through the chat
  template and the model's tool-call format (`tool_call_parser`) over each
  choice's text, a reasoning model's reasoning cut from its text
  (`reasoning_parser`, `gateway.protocol.reasoning`), the extra sampling fields and
  seed; `user` is logged only; vLLM's `return_token_ids`: the prompt's ids as made here,
  each choice's the engine's own, handed to its events by the tokens each counts;
  embeddings through `Embed` for an embedding model. Images are not served
  (see `VllmGrpcUpstream.features`).

Every failure, a gRPC status or a finish reason of `abort` or `error`, goes through
the one table below (`_from_rpc_error`, `FINISH_ERRORS`). SGLang's scheduler protocol
(`SglangScheduler`, same package) would be one more module of this shape: its own
proto messages around the same tokenization.

Rendering and tokenizing a prompt past `INLINE_CHARS` characters run in a small pool of
threads (`TOKENIZE_THREADS`), never on the event loop: a 4 MB prompt took 2.3-3.2 s of
the loop, stalling every stream of the process. A shorter one (the usual chat turn) is
done on the loop: tens of µs, less than the hop to the pool and back costs the loop. A
request's text is capped (`MAX_PROMPT_CHARS`, a 400 naming the parameter), so no one
request holds a thread for long. Embeddings are tokenized in one `encode_batch`
(Rust's threads); `Embed` takes one input per call, so at most `EMBED_CONCURRENCY` calls
of a request are in flight at once (2,048 inputs were 2,048 calls at once).

Cost (`benchmarks/profile_gateway.py`, py-spy against a stand-in engine): per request, the
template and the encoding of a short chat (~64 µs) are 2 % of the gateway's CPU, starting the
gRPC call 27 %; per token, the DecodeStream step (about 1.2 µs, a one-id message passed as
an int) and the tool-call parser are small beside grpc.aio's cost per message (a third of
the samples) and the SSE write per chunk, so the gateway's CPU follows the messages the
engine sends (vLLM's `--stream-interval`), not the tokens.
A choice with nothing between the detokenizer and its events (no tool-call parser, stop
strings, logprobs or min_tokens: `_Choice.plain`) turns a message's text into one `Text`
directly. `Generate`'s stream is read by the gateway's own HTTP/2 client on the loop
(`gateway.protocol.grpc_h2`): a grpc.aio read is a batch of gRPC core's completion queue,
handed to the loop by its poller thread, two wake-ups a token; ours is parsed in the
transport's callback (`benchmarks/bench_grpc_stream.py`: half grpc.aio's CPU a message at
one stream, under 0.4x at eight), and so is `SubscribeKvEvents` (a message a scheduler
step), in cleartext or over TLS (`worker_tls`: the same files, read by the `ssl`
module). The unary calls (model info, health, loads, Abort, Embed) stay on grpc.aio.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from gateway.protocol import errors, features, tool_calls
from gateway.protocol.grpc_h2 import ServerStream, StreamCall, StreamChannel
from gateway.protocol.kv_blocks import KvBatch
from gateway.protocol.kv_transfer import PREFILL_TRANSFER_JSON, kv_transfer_text
from gateway.protocol.reasoning import ReasoningSplitter, template_options
from gateway.protocol.status import error_from_status
from gateway.protocol.stop import StopMatcher
from gateway.protocol.tls import WorkerCredentials
from gateway.protocol.token_ids import IdsByCount
from gateway.protocol.tool_calls import ChoiceToolCalls
from gateway.protocol.types import (
    ChatForm,
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    Reasoning,
    Started,
    Text,
    TokenLogprob,
    Tokens,
    Tool,
)
from gateway.tokenization import ModelTokenizer, StreamDetokenizer, load_tokenizer
from gateway.upstreams.base import (
    CANCELLED,
    HEAD_GRACE,
    MAX_ENGINE_RANKS,
    CallEnd,
    ModelDescription,
    StreamBookkeeping,
    engine_address,
    engine_rank,
)
from gateway.upstreams.furnace_channel import open_channel
from gateway.upstreams.vllm_kv import RankedEvents, batch_from_vllm, subscribe_request
from gateway.worker.engine import chat_end, check_context, truncated

logger = logging.getLogger(__name__)

#: The engine's finish reasons: answers, or errors of the one tree.
FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
FINISH_ERRORS: dict[str, type[errors.GatewayError]] = {
    "abort": errors.Unavailable,  # aborted by the engine (shutdown, preemption)
    "error": errors.Failed,
}
#: vLLM refuses a prompt beyond its context as INVALID_ARGUMENT with these words.
_TOO_LONG = re.compile(r"maximum (model|context) length|longer than the maximum", re.I)
#: Seconds an `Abort` may take; it is best effort (the call's cancel aborts too).
ABORT_TIMEOUT = 2.0
_ABORTS: set[asyncio.Task[None]] = set()
#: Prompts the router encoded (`routing_ids`), by request, for the call about to start;
#: the oldest dropped past `ENCODED_KEPT` (a call that never started).
_ENCODED: OrderedDict[int, tuple[GenerateRequest, list[int]]] = OrderedDict()
ENCODED_KEPT = 256


#: `Text(text, tokens, index)` without the Python frame of a NamedTuple's `__new__` (its
#: fields all given: no logprobs, no token ids).
_new_text = cast(Callable[[type[Text], tuple[str, int, int, None, None]], Text], tuple.__new__)


def _tokens_to(pieces: Sequence[str], end: int) -> int:
    """How many of a message's tokens, of these texts, it takes to reach `end` characters:
    where vLLM cuts a message its stop string ended in (`BaseIncrementalDetokenizer.update`,
    the tokens up to the one whose text completed it; the engine may put several in a
    message)."""
    reached = 0
    for taken, piece in enumerate(pieces, 1):
        reached += len(piece)
        if reached >= end:
            return taken
    return len(pieces)


def _kept_ids(request: GenerateRequest) -> list[int] | None:
    kept = _ENCODED.pop(id(request), None)
    return kept[1] if kept is not None and kept[0] is request else None


def _keep(request: GenerateRequest, ids: list[int]) -> None:
    """The ids of `request`'s prompt, for the call that follows (`_kept_ids`)."""
    _ENCODED[id(request)] = (request, ids)
    if len(_ENCODED) > ENCODED_KEPT:
        _ENCODED.popitem(last=False)


def _json_object(text: str | None) -> object:
    """A JSON text's value; None where it is none or not JSON."""
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


T = TypeVar("T")
#: Threads that render chat templates and tokenize, per process (tokenizers' Rust code
#: releases the GIL in its batch calls; the Jinja part is Python but no longer the loop's).
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)
_TOKENIZE = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="furnace-tokenize")
#: The most characters of text (prompt or messages, tools' schemas, embeddings' inputs)
#: one request may give to be tokenized: ~256k tokens at 4 characters a token, more than
#: the models' contexts; 0.6-1.2 s of one pool thread (measured on the tiny test tokenizer).
MAX_PROMPT_CHARS = 1 << 20
#: Prompts of at most this many characters (as `prompt_chars` counts them) are rendered
#: and tokenized on the event loop: a short chat took 64 µs of CPU there, the hop to the
#: pool and back more of the loop's own (the pool's submit, the thread's wake-up and
#: GIL hand-offs: 9 % of the gateway's CPU per request, the vllm-grpc profile of
#: `benchmarks/profile_gateway.py`); 1 Ki characters take at most ~0.5 ms (the tiny test
#: tokenizer, whose small vocabulary makes many tokens of a word).
INLINE_CHARS = 1024
#: `Embed` calls of one request in flight at once.
EMBED_CONCURRENCY = 32


def _check_chars(chars: int, param: str) -> None:
    if chars > MAX_PROMPT_CHARS:
        raise errors.Invalid(
            f"The request holds {chars} characters to tokenize; this model takes at most "
            f"{MAX_PROMPT_CHARS}.",
            param=param,
        )


def prompt_chars(
    prompt: str | None, messages: Sequence[Message] | None, tools: Sequence[Tool]
) -> int:
    """The characters a prompt puts through the template and the tokenizer."""
    chars = len(prompt or "")
    if tools:  # each generator below only where there is something to count
        chars += sum(len(t.parameters) + len(t.description) for t in tools)
    for m in messages or ():
        chars += len(m.content)
        if m.tool_calls:
            chars += sum(len(c.arguments) for c in m.tool_calls)
    return chars


async def _off_loop(function: Callable[[], T]) -> T:
    """`function`'s result, computed in the tokenizing pool."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE, function)


#: The HTTP/2 paths of the streams read on the loop.
_SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
GENERATE = f"/{_SERVICE}/Generate"
SUBSCRIBE_KV_EVENTS = f"/{_SERVICE}/SubscribeKvEvents"


def _from_rpc_error(error: grpc.RpcError) -> errors.GatewayError:
    """The one table from vLLM's statuses to our errors: ours, plus its wording of
    a prompt too long for the context."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return errors.Unavailable(f"vLLM worker call failed: {error}")
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT and _TOO_LONG.search(details):
        return errors.TooLong(details)
    return error_from_status(code, details, None)


class _Choice:
    """One choice's way from the engine's token ids to our events: its own
    detokenizer, stop strings and tool-call parser."""

    __slots__ = (
        "calls",
        "completed",
        "detok",
        "done",
        "held",
        "ids",
        "index",
        "plain",
        "received",
        "stop",
        "thoughts",
    )

    #: Made once the prompt's ids are known (`VllmGrpcCall._start`): it starts after them.
    detok: StreamDetokenizer

    def __init__(self, call: VllmGrpcCall, index: int) -> None:
        upstream, request = call._upstream, call._request
        self.index = index
        parser = tool_calls.for_request(request, upstream.tool_call_parser)
        #: A reasoning model's: its reasoning cut from its text; None: no parser.
        self.thoughts = (
            None
            if upstream.reasoning_parser is None
            else ReasoningSplitter(upstream.reasoning_parser)
        )
        #: Nothing between the detokenizer and our events (no tool-call parser, stop
        #: strings, logprobs, min_tokens or reasoning): each message's text is one `Text`
        #: at once.
        self.plain = (
            parser is None
            and not any(request.stop)
            and request.logprobs is None
            and not request.sampling.min_tokens
            and self.thoughts is None
            and not request.return_token_ids
        )
        #: The engine's ids, handed to the events by their counts (`return_token_ids`).
        self.ids = IdsByCount() if request.return_token_ids else None
        if not self.plain:  # a plain choice has neither: `_plain` and `_finish` stand in
            self.stop = StopMatcher(request.stop, request.include_stop)
            self.calls = ChoiceToolCalls(parser, index)
        self.held = 0  # plain: tokens whose text is not out yet (a character's pieces)
        self.received = 0  # completion tokens seen
        self.done = False  # its Finished is out
        self.completed = False  # the engine said it ended


class VllmGrpcCall(StreamBookkeeping):
    """One request: prepares on the first read (model info, the prompt's ids), then
    turns the engine's token-id chunks, of each of its n choices, into our events."""

    __slots__ = (
        "_cached",
        "_call",
        "_choices",
        "_deadline",
        "_hidden",
        "_left",
        "_listener",
        "_metadata",
        "_pending",
        "_polling",
        "_prompt_ids",
        "_prompt_tokens",
        "_pushing",
        "_request",
        "_sole",
        "_started",
        "_unread",
        "_upstream",
        "request_id",
    )

    def __init__(
        self,
        upstream: VllmGrpcUpstream,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...],
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(upstream.address, on_close)
        self._upstream = upstream
        self._request = request
        self._deadline = time.monotonic() + timeout
        self._metadata = metadata
        #: The engine's id of the request (unique per attempt), for `Abort`.
        # 48 random bits, as a uuid4's first 12 hex digits were, without its object
        self.request_id = f"{request.request_id or 'furnace'}-{os.urandom(6).hex()}"
        self._call: ServerStream[pb.GenerateResponse] | None = None
        self._pending: deque[Event] = deque()
        self._choices: list[_Choice] = []
        #: The one choice, when it is plain (`_Choice.plain`): `drain`'s path.
        self._sole: _Choice | None = None
        self._left = 0  # choices whose Finished is not out yet
        self._hidden: frozenset[int] = frozenset()  # ids whose text is never shown
        self._started = False
        self._unread = True  # no message of the engine read yet (its counts)
        self._cached: int | None = None  # its cached count, when Started could not say it
        self._prompt_tokens = 0  # the ids sent, which the engine counts as the prompt
        self._prompt_ids: tuple[int, ...] | None = None  # them, for `return_token_ids`
        self._listener: Callable[[], None] | None = None
        self._polling = False  # inside `poll`, which hears its own call's end itself
        self._pushing: StreamCall[pb.GenerateResponse] | None = None  # once `listen` said so

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            try:
                if self._call is None:
                    call = self._call = await self._start()
                    # the engine prefills: Started now, unless its first message (or its
                    # refusal) comes within HEAD_GRACE (a grpc.aio call, whose read cannot
                    # be waited on apart from taking it, is read at once)
                    if isinstance(call, StreamCall) and not await call.arrived(HEAD_GRACE):
                        self._started = True
                        return Started(self._prompt_tokens, 0, self._prompt_ids)
                message = await self._call.read()
            except grpc.RpcError as error:
                raise self._failed(error) from None
            except errors.GatewayError as failure:
                self.close(failure)
                raise
            self._took(message)
        return self._pending.popleft()

    def listen(self, listener: Callable[[], None] | None) -> bool:
        """Once started, calls `listener` whenever events may be ready (None: stop), in
        the connection's callback that brought the engine's messages: no task reads
        the call, and the engine's message reaches the edge in one wake of the loop.
        False where the stream cannot push (a grpc.aio call): read it instead."""
        call = self._call
        if not isinstance(call, StreamCall):
            return False
        self._listener = listener
        self._pushing = call
        call.listen(None if listener is None else self._pushed)
        return True

    def _pushed(self) -> None:
        if not self._polling and self._listener is not None:
            self._listener()

    def poll(self) -> Event | None:
        """The next event ready, or None while there is none; raises the call's
        error, or StopAsyncIteration at its end, as `__anext__` would."""
        pending = self._pending
        if pending:
            return pending.popleft()
        call = self._pushing
        assert call is not None, "poll() before listen() said the call pushes"
        if self._closed:
            raise StopAsyncIteration
        if not call._messages and not call._done:  # the usual last poll of a push
            return None
        self._polling = True
        try:
            while not pending:
                if self._closed:
                    raise StopAsyncIteration
                try:
                    message = call.poll()
                except grpc.RpcError as error:
                    raise self._failed(error) from None
                if message is None:
                    return None
                self._took(message)
        finally:
            self._polling = False
        return pending.popleft()

    def drain(self, ready: list[Event], room: int) -> int:
        """The texts of the one plain choice's chunks that came, appended to `ready` (the
        pump's list) until their characters pass `room` or a message of another kind is
        next (`poll` then gives its events): a read's tokens in one call, not a `poll`
        each. Their characters."""
        sole, call = self._sole, self._pushing
        if (
            sole is None
            or call is None
            or self._pending
            or self._closed
            or not self._started
            or sole.done  # only `_took` ends it, and the loop stops there
        ):
            return 0
        messages, hidden, feed_one = call._messages, self._hidden, sole.detok.feed_one
        taken = 0
        self._polling = True
        try:
            while messages and taken <= room:
                try:
                    message: pb.GenerateResponse = call.poll()  # type: ignore[assignment]
                except grpc.RpcError as error:
                    raise self._failed(error) from None
                # a message of another kind reads as an empty chunk: no one token in it
                chunk = message.chunk
                token_ids = chunk.token_ids
                if chunk.index or len(token_ids) != 1:
                    self._took(message)  # its events wait in `_pending` for `poll`
                    break
                sole.received += 1
                token = token_ids[0]
                text = "" if token in hidden else feed_one(token)
                if text:
                    ready.append(_new_text(Text, (text, sole.held + 1, 0, None, None)))
                    sole.held = 0
                    taken += len(text)
                else:
                    sole.held += 1
        finally:
            self._polling = False
        return taken

    def _failed(self, error: grpc.RpcError) -> errors.GatewayError:
        """The call failed: our error for it, told to the owner."""
        failure = _from_rpc_error(error)
        self.close(failure)
        return failure

    def _took(self, message: object) -> None:
        """Our events for one message of the stream, or its end, which is too early."""
        if message is grpc.aio.EOF:
            cut = errors.Unavailable("The vLLM worker ended the answer without finishing.")
            self.close(cut)
            raise cut
        try:
            self._take(message)  # type: ignore[arg-type]
        except errors.GatewayError as failure:
            self.cancel(failure)
            raise

    async def _start(self) -> ServerStream[pb.GenerateResponse]:
        upstream, request = self._upstream, self._request
        n = request.n
        # (refuses tools first; the usual one choice without a comprehension's frame)
        choices = [_Choice(self, 0)] if n == 1 else [_Choice(self, i) for i in range(n)]
        self._choices = choices
        self._left = n
        if n == 1 and choices[0].plain:
            self._sole = choices[0]
        info = upstream._info or await upstream.model_info(  # asked once (kept: never falsy)
            max(0.001, self._deadline - time.monotonic())
        )
        # the ids the router encoded for this request (`routing_ids`), if any, else made here
        ids = (_ENCODED and _kept_ids(request)) or await upstream.prompt_ids(request)
        ids = truncated(ids, request, info.max_context_length)  # (truncate_prompt_tokens)
        self._prompt_tokens = prompt_tokens = len(ids)
        if request.return_token_ids:
            self._prompt_ids = tuple(ids)
        max_tokens = check_context(request, prompt_tokens, info.max_context_length)
        # each choice's text decoded after the prompt, as vLLM's server decodes it
        tokenizer = upstream.tokenizer
        context = tokenizer.context(ids)
        skip = request.skip_special_tokens and not (
            upstream.tool_call_parser in tool_calls.KEEP_SPECIAL_TOKENS
            and request.tools
            and request.tool_choice != "none"
        )
        for choice in choices:
            choice.detok = tokenizer.detokenizer(context, skip)
        sampling = request.sampling
        if sampling.stop_token_ids or sampling.ignore_eos:
            stop_ids = set(sampling.stop_token_ids)
            if not sampling.ignore_eos:
                stop_ids.update(info.eos_token_ids)
            stops = sorted(stop_ids)
            self._hidden = frozenset(stop_ids).union(info.eos_token_ids)
        else:  # the usual request: the EOS ids alone, as both (made with `info`)
            stops, self._hidden = upstream._eos
        if request.user:  # taken for the record; the engine has no field for it
            logger.debug("request %s: user %r", request.request_id, request.user)
        message = pb.GenerateRequest(
            request_id=self.request_id,
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=sampling_params(request, max_tokens, stops),
            stream=True,
        )
        if request.kv_transfer:  # its prompt's KV blocks prefilled elsewhere, to pull
            message.kv_transfer_params_json = request.kv_transfer
        if upstream.data_parallel_rank is not None:
            message.data_parallel_rank = upstream.data_parallel_rank
        timeout = self._deadline - time.monotonic()
        if timeout <= 0:
            raise errors.Timeout("The request's deadline passed before it reached the engine.")
        return upstream.generate(message, timeout, self._metadata)

    def _take(self, message: pb.GenerateResponse) -> None:
        """Our events for one message of the engine: deltas, then how a choice ended."""
        kind = message.WhichOneof("response")
        if kind == "chunk":
            chunk = message.chunk
            choice = self._choice(chunk.index)
            if self._unread:  # the engine's first message: its counts
                self._unread = False
                if self._started:  # Started went out at HEAD_GRACE, without them
                    self._cached = chunk.cached_tokens
                else:
                    self._started = True
                    started = Started(chunk.prompt_tokens, chunk.cached_tokens, self._prompt_ids)
                    self._pending.append(started)
            if choice.plain:  # its logprobs field is not read (a message object each)
                self._plain(choice, chunk.token_ids)
            elif not choice.done:
                self._text(choice, chunk.token_ids, chunk.output_logprobs)
        elif kind == "complete":
            done = message.complete
            choice = self._choice(done.index)
            choice.completed = True
            failure = FINISH_ERRORS.get(done.finish_reason)
            if failure is not None or done.finish_reason not in FINISH_REASONS:
                failure = failure or errors.Failed
                raise failure(f"The vLLM worker ended the answer: {done.finish_reason or '?'}")
            if not self._started:  # nothing streamed before: the engine's counts alone
                self._started = True
                self._pending.append(
                    Started(done.prompt_tokens, done.cached_tokens, self._prompt_ids)
                )
            if not choice.done:
                if not choice.received:  # a choice whose tokens came only here
                    self._text(choice, done.output_ids, done.output_logprobs)
                if not choice.done:
                    reason = FINISH_REASONS[done.finish_reason]
                    # the prompt's cached count again: a Started sent before the engine's
                    # first message (HEAD_GRACE) could not say it
                    self._finish(choice, reason, done.completion_tokens, done.cached_tokens)

    def _choice(self, index: int) -> _Choice:
        if index >= len(self._choices):
            raise errors.Failed(f"The vLLM worker answered choice {index} of {len(self._choices)}.")
        return self._choices[index]

    def _logprobs(self, ids: list[int], logprobs: pb.OutputLogProbs) -> tuple[TokenLogprob, ...]:
        """The tokens' logprobs, each with its top alternatives (as many as asked,
        most likely first), named by their own text as vLLM names them."""
        text = self._upstream.tokenizer.token_text
        asked = self._request.logprobs or 0
        out = []
        for i, value in enumerate(logprobs.token_logprobs):
            token_id = logprobs.token_ids[i] if i < len(logprobs.token_ids) else ids[i]
            top: list[tuple[str, float]] = []
            if asked and i < len(logprobs.top_logprobs):
                alternatives = logprobs.top_logprobs[i]
                pairs = sorted(zip(alternatives.values, alternatives.token_ids, strict=False))
                top = [(text(t), v) for v, t in reversed(pairs)][:asked]
            out.append(TokenLogprob(text(token_id), value, tuple(top)))
        return tuple(out)

    def _plain(self, choice: _Choice, token_ids: Sequence[int]) -> None:
        """A plain choice's tokens: what `ChoiceToolCalls` would give, directly."""
        if choice.done:
            return
        count = len(token_ids)
        choice.received += count
        hidden = self._hidden
        if count == 1:  # vLLM's usual message: no list made of the repeated field
            token = token_ids[0]
            text = "" if token in hidden else choice.detok.feed_one(token)
        else:
            ids = list(token_ids)
            if not hidden.isdisjoint(ids):  # in C, where a comprehension is a Python loop
                ids = [i for i in ids if i not in hidden]
            text = choice.detok.feed(ids)
        if text:
            self._pending.append(
                _new_text(Text, (text, choice.held + count, choice.index, None, None))
            )
            choice.held = 0
        else:
            choice.held += count

    def _text(self, choice: _Choice, token_ids: Sequence[int], logprobs: pb.OutputLogProbs) -> None:
        if choice.plain:
            self._plain(choice, token_ids)
            return
        hidden, request = self._hidden, self._request
        ids = list(token_ids)
        first = len(self._pending)  # where this message's events start
        sampled = ids
        scores = None if request.logprobs is None else self._logprobs(ids, logprobs)
        received, count = choice.received, len(ids)
        choice.received = received + count
        # as vLLM, the text of the first min_tokens tokens is never cut by a stop string
        exempt = (request.sampling.min_tokens or 0) - received
        released = ""
        if exempt > 0:
            shown = [i for i in ids[:exempt] if i not in hidden]
            released = choice.detok.feed(shown) if shown else ""
            ids = ids[exempt:]
        stop = choice.stop
        if len(ids) > 1 and stop.active:  # a stop string may end at any of them: each's text
            feed_one = choice.detok.feed_one
            pieces = ["" if i in hidden else feed_one(i) for i in ids]
            more, stopped = stop.feed("".join(pieces))
            if stopped:  # the tokens after the one that completed it are not the answer's
                dropped = len(ids) - _tokens_to(pieces, stop.end)
                choice.received -= dropped
                count -= dropped
                sampled = sampled[: len(sampled) - dropped]
                if scores:
                    scores = scores[: len(scores) - dropped]
        else:
            more, stopped = stop.feed(choice.detok.feed([i for i in ids if i not in hidden]))
        released += more
        thoughts = choice.thoughts
        if thoughts is not None:  # after a stop string nothing follows: nothing held back
            split = thoughts.last(released) if stopped else thoughts.feed(released)
            released, count = self._think(choice, split, count)
        self._pending.extend(choice.calls.feed(released, count, scores))
        if choice.ids is not None:
            choice.ids.add(sampled)
            self._with_ids(choice.ids, first)
        if stopped:  # a stop string: the choice ends here, before the engine's end
            self._finish(choice, FinishReason.STOP, choice.received, self._cached, flush=False)

    def _think(self, choice: _Choice, split: tuple[str, str], tokens: int) -> tuple[str, int]:
        """A piece's reasoning as a `Reasoning` (with the piece's tokens where it holds
        no text), unless the request asked for none (vLLM's `include_reasoning`); the
        text and the tokens left for it."""
        thought, text = split
        if thought:
            shown = self._request.reasoning is None or self._request.reasoning.include
            if shown:
                self._pending.append(Reasoning(thought, 0 if text else tokens, choice.index))
            if not text:
                return "", 0 if shown else tokens
        return text, tokens

    def _finish(
        self,
        choice: _Choice,
        reason: FinishReason,
        completion_tokens: int,
        cached_tokens: int | None = None,
        *,
        flush: bool = True,
    ) -> None:
        # The detokenizer is not flushed: the first bytes of a character the answer ended in
        # are dropped, as vLLM's server drops them (its detokenizer's text is all it says).
        first = len(self._pending)
        if choice.plain:
            stop = ""
        else:
            if flush:  # what the stop strings and the reasoning held back
                rest = choice.stop.flush()
                if choice.thoughts is not None:
                    rest, _ = self._think(choice, choice.thoughts.last(rest), 0)
                self._pending.extend(choice.calls.feed(rest, 0))
            self._pending.extend(choice.calls.finish())
            reason = choice.calls.finish_reason(reason)
            stop = choice.stop.matched if reason is FinishReason.STOP else ""
        tokens = max(completion_tokens, choice.received)
        self._pending.append(Finished(reason, tokens, None, choice.index, stop, cached_tokens))
        if choice.ids is not None:
            self._with_ids(choice.ids, first)
        choice.done = True
        self._left -= 1
        if self._left == 0:
            if not all(c.completed for c in self._choices):  # stop strings ended it: stop it
                self._abort()
            self.close()

    def _with_ids(self, ids: IdsByCount, first: int) -> None:
        """The events pending from `first` on (of one choice), each with its ids."""
        pending = self._pending
        made = [pending.pop() for _ in range(len(pending) - first)]
        made.reverse()
        pending.extend(ids.attach(made))

    def _abort(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._upstream.abort(self.request_id)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Cancels the call and aborts the request on the engine; `outcome` is
        what the owner hears: our own cancellation, or a failure we saw."""
        self._abort()
        self.close(outcome)


#: vLLM's proto takes the seed as an int32.
_SEED_RANGE = range(-(2**31), 2**31)


def sampling_params(
    request: GenerateRequest, max_tokens: int, stop_token_ids: list[int]
) -> pb.SamplingParams:
    """The engine's sampling parameters for `request`: every field we serve has
    its place in vLLM's proto (0 there is the engine's default); the JSON schema
    of a forced tool call, or of `response_format`, is its constraint."""
    s = request.sampling
    # The settings the client gave (`SamplingParams.given`, made in C), each a field of the
    # same name: temperature, top_p, top_k, presence_penalty, frequency_penalty, seed,
    # min_tokens, ignore_eos, repetition_penalty, min_p. One not given stays unset: the
    # engine's default (a field without presence reads 0, which vLLM takes as its default:
    # top_p 1.0, repetition_penalty 1.0); temperature and seed have presence.
    given = s.given()
    given["max_tokens"] = max_tokens  # within the context (`check_context`)
    seed = given.pop("seed", None)
    if "ignore_eos" in given:
        given["ignore_eos"] = bool(given["ignore_eos"])
    if s.logit_bias:
        given["logit_bias"] = dict(s.logit_bias)
    params = pb.SamplingParams(stop_token_ids=stop_token_ids, n=request.n, **given)
    if seed is not None:
        if seed not in _SEED_RANGE:
            raise errors.Invalid("This model takes a seed that fits 32 bits.", param="seed")
        params.seed = seed
    if request.logprobs is not None:
        params.logprobs = request.logprobs
    if request.tools and tool_calls.forced(request.tool_choice):
        # a forced call wins over response_format, as in vLLM's server: the
        # answer is the call, there is no content for the format to shape
        params.json_schema = tool_calls.required_schema(
            request.tools, request.tool_choice, request.parallel_tool_calls
        )
    elif request.response_format is not None:
        answer = request.response_format
        kind = answer.type
        if kind == "json_schema":
            params.json_schema = answer.schema
        elif kind == "regex":
            params.regex = answer.regex
        elif kind == "choice":
            params.choice.choices.extend(answer.choice)
        elif kind == "grammar":
            params.grammar = answer.grammar
        else:
            params.json_object = True
    return params


#: What a generative vLLM engine serves beyond text (with `tools` when the model's
#: call format is configured): every field its `SamplingParams` has a place for.
GENERATIVE = (
    features.SAMPLING
    | {
        features.GENERATE,
        features.N,
        features.LOGPROBS,
        features.RESPONSE_FORMAT,
        features.USER,
        features.INCLUDE_STOP,  # the gateway matches the stop strings
        features.SKIP_SPECIAL_TOKENS,  # and decodes the answer
        features.TRUNCATE_PROMPT_TOKENS,  # and tokenizes the prompt
        features.RETURN_TOKEN_IDS,  # the prompt's ids made here, the answer's the engine's
    }
    | features.STRUCTURED
)

#: KV-cache use at which a vLLM engine counts as full (it would preempt or queue).
KV_FULL = 0.98


def engine_load(loads: Iterable[pb.SchedulerLoad]) -> tuple[int, bool]:
    """Requests a vLLM engine runs (summed over its data-parallel ranks), and whether it
    is full: requests waiting in its scheduler, or its KV cache all but used up."""
    running = waiting = 0
    full = False
    for load in loads:
        running += load.num_running_reqs
        waiting += load.num_waiting_reqs
        full = full or load.token_usage >= KV_FULL
    return running, full or waiting > 0


class VllmGrpcUpstream:
    """One vLLM gRPC server, over one channel created on the running loop; the
    model's tokenizer is shared by every worker of the model."""

    def __init__(
        self,
        address: str,
        *,
        model: str,
        tokenizer: str,
        tool_call_parser: str | None = None,
        credentials: WorkerCredentials | None = None,
        plain_text_contents: bool = True,
        reasoning_parser: str | None = None,
        data_parallel_rank: int | None = None,
        ranked_events: RankedEvents | None = None,
    ) -> None:
        """`data_parallel_rank`: one engine of a data-parallel server
        (`gateway.fleet.data_parallel`): its requests pinned to it, its KV events and
        load records those of that rank (`ranked_events`: the stream the server's
        engines share, else one of its own)."""
        self.address = engine_address(address, data_parallel_rank)  # its calls' worker
        self.data_parallel_rank = data_parallel_rank
        #: Its engine's data-parallel rank, as its loads and KV events name it (`describe`).
        self.engine_rank = data_parallel_rank
        self.ranked_events = ranked_events
        self.model = model
        self.tokenizer: ModelTokenizer = load_tokenizer(tokenizer)
        #: Special-token strings in messages' contents stay text (see the tokenizer).
        self.plain_contents = plain_text_contents
        #: The format the model writes tool calls in; None: it takes no tools.
        self.tool_call_parser = tool_call_parser
        #: How the model opens its thought (`gateway.protocol.reasoning`); None: its
        #: answer is all text.
        self.reasoning_parser = reasoning_parser
        self._channel = open_channel(address, credentials)
        #: Generate's streams, read on the loop (`gateway.protocol.grpc_h2`): half
        #: grpc.aio's CPU a token. To an address that is not host:port (a `dns:///`
        #: target), or TLS files the `ssl` module cannot read, they stay on the
        #: grpc.aio channel.
        self._streams: StreamChannel | None = None
        if credentials is None or credentials.context is not None:
            tls = None if credentials is None else credentials.context
            name = None if credentials is None else credentials.server_name
            with contextlib.suppress(ValueError):
                self._streams = StreamChannel(address, tls, name)
        self.stub = pb_grpc.VllmEngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info: pb.GetModelInfoResponse | None = None
        #: The EOS ids of `_info`, sorted and as a set, made with it: the stop token ids of
        #: a request that names none of its own, and the ids never shown (shared: unchanged).
        self._eos: tuple[list[int], frozenset[int]] = ([], frozenset())
        #: Its `GetServerInfo` (asked until it names a KV connector; again once the
        #: server was unreachable).
        self._server_info: pb.GetServerInfoResponse | None = None

    def call(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> VllmGrpcCall:
        """A call that starts on its first read, within `timeout` seconds."""
        return VllmGrpcCall(self, request, timeout, metadata, on_close)

    def generate(
        self, message: pb.GenerateRequest, timeout: float, metadata: tuple[tuple[str, str], ...]
    ) -> ServerStream[pb.GenerateResponse]:
        """`Generate`'s stream of `message`, started on its first read."""
        if self._streams is None:
            call: ServerStream[pb.GenerateResponse]
            call = self.stub.Generate(message, timeout=timeout, metadata=metadata)
            return call
        return self._streams.unary_stream(
            GENERATE, message.SerializeToString(), pb.GenerateResponse.FromString, timeout, metadata
        )

    async def model_info(self, deadline: float) -> pb.GetModelInfoResponse:
        """The engine's GetModelInfo (context length, EOS ids), asked once."""
        if self._info is None:
            try:
                info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=deadline)
            except grpc.RpcError as error:
                raise _from_rpc_error(error) from None
            eos = set(info.eos_token_ids)
            self._info, self._eos = info, (sorted(eos), frozenset(eos))
        return self._info

    def features(self, info: pb.GetModelInfoResponse) -> frozenset[str]:
        """What this engine serves: an embedding model (`is_generation` false)
        embeds, through `Embed`; a generative one takes every field its proto
        has a place for, and tools when the model's call format is configured
        and its chat template reads them.
        Not `image_url`: the proto takes images as preprocessed tensors or as
        media references expanded over placeholder tokens, neither of which the
        gateway builds (it would need the model's image processor), and the
        gateway never fetches a URL for a worker. Nor `dimensions`: `Embed` has
        no field for it."""
        if not info.is_generation:
            pooling = frozenset({features.EMBEDDINGS, features.USER, features.TOKENIZE})
            if self.tokenizer.has_chat_template:  # the chat form: the gateway renders it
                pooling |= {features.EMBEDDING_CHAT}
            return pooling
        served = GENERATIVE | {features.TOKENIZE}
        if self.tokenizer.has_chat_template:  # the template's ends, as vLLM renders them
            served |= features.CHAT_END
        if self.tool_call_parser is not None and self.tokenizer.reads_tools:
            served |= {features.TOOLS}
        if self.reasoning_parser is not None:
            served |= {features.INCLUDE_REASONING}
        if self.tokenizer.has_chat_template:  # the template's variables, as vLLM sets them
            served |= {features.REASONING_EFFORT, features.CHAT_TEMPLATE_KWARGS}
        return served

    async def count_tokens(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """The prompt's tokens by the gateway's own tokenizer and template, as a call
        would send them; the engine is not asked."""
        async with asyncio.timeout(timeout):
            return len(await self.prompt_ids(request))

    async def tokenize(
        self,
        request: GenerateRequest,
        token_strs: bool,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Tokens:
        """`count_tokens`' ids, with their strings when asked (off the loop past
        `INLINE_CHARS` ids); the engine is not asked."""
        async with asyncio.timeout(timeout):
            ids = await self.prompt_ids(request)
            if not token_strs:
                return Tokens(ids)
            strs = functools.partial(self.tokenizer.token_strs, ids)
            return Tokens(ids, strs() if len(ids) <= INLINE_CHARS else await _off_loop(strs))

    async def detokenize(
        self,
        model: str,
        ids: list[int],
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> str:
        """The text of `ids` by the gateway's own tokenizer, special tokens kept (as
        vLLM's `/detokenize`); off the loop past `INLINE_CHARS` ids."""
        tokenizer = self.tokenizer
        vocabulary = tokenizer.vocab_size
        outside = next((i for i in ids if i >= vocabulary), None)
        if outside is not None:
            raise errors.Invalid(
                f"Token id {outside} is outside the vocabulary of `{model}` ({vocabulary} tokens).",
                param="tokens",
            )
        decode = functools.partial(tokenizer.decode, ids, skip_special_tokens=False)
        if len(ids) <= INLINE_CHARS:
            return decode()
        async with asyncio.timeout(timeout):
            return await _off_loop(decode)

    async def routing_ids(self, request: GenerateRequest) -> list[int]:
        """`prompt_ids` for the router (`gateway.fleet.routing`), kept for the call that
        follows on whichever worker it picks, so a prompt is encoded once (a prefill's
        too: `prefill`)."""
        ids = (_ENCODED and _kept_ids(request)) or await self.prompt_ids(request)
        _keep(request, ids)
        return ids

    async def prefill(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline too)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> GenerateRequest:
        """The engine's prefill of the request's prompt (`Prefills`): one token, its KV
        blocks kept for a decode worker, within `timeout` seconds; the request with where
        the blocks are, its ids kept for the decode call (as `routing_ids` keeps them)."""
        ids = (_ENCODED and _kept_ids(request)) or await self.prompt_ids(request)
        if request.truncate_prompt_tokens is not None:  # the prompt the decode call sends
            info = self._info or await self.model_info(timeout)
            ids = truncated(ids, request, info.max_context_length)
        message = pb.GenerateRequest(
            request_id=f"{request.request_id or 'furnace'}-prefill-{os.urandom(6).hex()}",
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=pb.SamplingParams(max_tokens=1, n=1),
            stream=False,
            kv_transfer_params_json=PREFILL_TRANSFER_JSON,
            data_parallel_rank=self.data_parallel_rank,
        )
        params = None
        try:
            async with asyncio.timeout(timeout):
                call = self.stub.Generate(message, timeout=timeout, metadata=metadata)
                async for reply in call:
                    if reply.HasField("complete"):
                        params = reply.complete.kv_transfer_params_json or None
        except TimeoutError:
            raise errors.Timeout("The prefill worker did not prefill in time.") from None
        except grpc.RpcError as error:
            raise _from_rpc_error(error) from None
        decoded = replace(request, kv_transfer=kv_transfer_text(_json_object(params)))
        _keep(decoded, ids)
        return decoded

    async def kv_events(self, model: str) -> AsyncIterator[KvBatch]:
        """The engine's KV-cache events and load records (`SubscribeKvEvents`, which
        vLLM serves when started with `--kv-events-config`), ours (`vllm_kv`), until
        the stream ends; a `GatewayError` when it breaks (`Invalid`: UNIMPLEMENTED). One
        engine of a data-parallel server: its rank's batches (each rank numbers its own),
        from the stream its server's engines share (`RankedEvents`)."""
        rank, ranked = self.engine_rank, self.ranked_events
        relay = (
            self._relay() if rank is None or ranked is None else ranked.follow(rank, self._relay)
        )
        first = True
        async for message in relay:
            yield batch_from_vllm(message, first)
            first = False

    async def _relay(self) -> AsyncIterator[common.KvEventBatch]:
        """The server's `SubscribeKvEvents` stream, every rank's batches."""
        request = subscribe_request()
        call: ServerStream[common.KvEventBatch]
        if self._streams is None:
            call = self.stub.SubscribeKvEvents(request)
        else:  # a message a scheduler step: read on the loop, as Generate is
            call = self._streams.unary_stream(
                SUBSCRIBE_KV_EVENTS,
                request.SerializeToString(),
                common.KvEventBatch.FromString,
                None,
            )
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                yield cast(common.KvEventBatch, message)
        except grpc.RpcError as error:
            raise _from_rpc_error(error) from None
        finally:
            call.cancel()

    async def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The ids of the request's prompt, made on the loop up to `INLINE_CHARS`
        characters, else in the tokenizing pool (a 400 past `MAX_PROMPT_CHARS`)."""
        # the template shows the tools unless none may be called (as our other engines)
        tools = request.tools if request.tool_choice != "none" else ()
        prompt, messages = request.prompt, request.messages
        chars = prompt_chars(prompt, messages, tools)
        reasoning = request.reasoning
        ends = chat_end(request)  # as the engines end it
        make = functools.partial(
            self.tokenizer.prompt_ids,
            prompt,
            messages,
            tools,
            plain_contents=self.plain_contents,
            options=None if reasoning is None else template_options(reasoning),
            generation=ends["add_generation_prompt"],
            open_end=ends["continue_final_message"],
        )
        if chars <= INLINE_CHARS:  # (below MAX_PROMPT_CHARS: nothing to refuse)
            return make()
        _check_chars(chars, "prompt" if messages is None else "messages")
        return await _off_loop(make)

    async def server_info(self, deadline: float) -> pb.GetServerInfoResponse | None:
        """The engine's `GetServerInfo` (its KV connector, "" for none, the connector's
        role, and its data-parallel engines): asked at every describe until it names a
        connector (a server restarted at its address with `--kv-transfer-config` is
        seen), then kept until the server cannot be reached (`watch_health`: one
        restarted with another role is seen); None from a server without the call."""
        info = self._server_info
        if info is None or not info.kv_connector:
            try:
                info = await self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=deadline)
            except grpc.RpcError:  # an older server, or none now: nothing said
                return None
            self._server_info = info
        return info

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The model this worker serves for the gateway (it has no name of its own
        beyond a path), with the engine's context length, features, KV connector and
        data-parallel engines."""
        info = await self.model_info(deadline)
        server = await self.server_info(deadline)
        # (0: a servicer older than the field says nothing of it)
        size = 0 if server is None else min(server.data_parallel_size, MAX_ENGINE_RANKS)
        mine = ModelDescription(
            self.model,
            info.max_context_length,
            features=self.features(info),
            kv_connector=None if server is None else server.kv_connector,
            kv_role=None if server is None else server.kv_role,
            engine_ranks=tuple(range(size)) if size else None,
        )
        try:
            reply = await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=deadline)
        except grpc.RpcError:  # an engine without load reports is served all the same
            return [mine]
        loads = reply.loads
        ranks = mine.engine_ranks
        listed = sorted({load.dp_rank for load in loads[:MAX_ENGINE_RANKS]})
        if listed and listed[0] > 0:
            # GetServerInfo gives the whole group's size; a server whose first rank (one
            # it always lists) is not 0 runs a slice of the ranks (vLLM's external or
            # hybrid load balancing): those it lists (a rank lists once it has stepped)
            ranks = tuple(listed)
        index = self.data_parallel_rank
        if index is not None:  # one engine's load, not the server's
            rank = self.engine_rank = engine_rank(ranks, index)
            loads = [load for load in loads if load.dp_rank == rank]
        running, full = engine_load(loads)
        return [replace(mine, load=running, full=full, engine_ranks=ranks)]

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline, as the Upstream interface has it)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        """The inputs' vectors from the engine's `Embed`, one call per input (the
        rpc takes one), `EMBED_CONCURRENCY` at a time; texts tokenized as raw prompts,
        all in one batch off the loop; a conversation (the chat form) rendered by the
        model's chat template with its options and tokenized, as vLLM's server does,
        off the loop."""
        if request.dimensions is not None:
            raise errors.Invalid("This model cannot shorten its vectors.", param="dimensions")
        deadline = time.monotonic() + timeout
        info = await self.model_info(timeout)
        if info.is_generation:
            raise errors.Invalid(f"{self.model} is not an embedding model.", param="model")
        if request.user:
            logger.debug("embed %s: user %r", request.request_id, request.user)
        base = request.request_id or "furnace"
        if request.chat is not None:
            inputs = await _off_loop(functools.partial(self._conversations_ids, request.chat))
        else:
            texts = [x for x in request.inputs if isinstance(x, str)]
            _check_chars(sum(map(len, texts)), "input")
            encoded = iter(await _off_loop(functools.partial(self.tokenizer.encode_batch, texts)))
            inputs = [next(encoded) if isinstance(x, str) else list(x) for x in request.inputs]
        limit = asyncio.Semaphore(EMBED_CONCURRENCY)

        async def one(i: int, ids: list[int]) -> pb.EmbedResponse:
            message = pb.EmbedRequest(
                request_id=f"{base}-{os.urandom(6).hex()}-{i}",
                tokenized=pb.TokenizedInput(input_ids=ids),
            )
            async with limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.Timeout(
                        "The request's deadline passed before it reached the engine."
                    )
                reply: pb.EmbedResponse = await self.stub.Embed(
                    message, timeout=left, metadata=metadata
                )
            return reply

        try:
            replies = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(inputs)))
        except grpc.RpcError as error:
            raise _from_rpc_error(error) from None
        return Embeddings(
            tuple(tuple(r.embedding) for r in replies), sum(r.prompt_tokens for r in replies)
        )

    def _conversations_ids(self, chat: ChatForm) -> list[list[int]]:
        """Each conversation's ids, rendered with the chat form's options (in the
        tokenizing pool: a 400 past `MAX_PROMPT_CHARS` in all)."""
        chars = sum(prompt_chars(None, c, ()) for c in chat.conversations)
        _check_chars(chars, "messages")
        options = json.loads(chat.template_kwargs) if chat.template_kwargs else None
        make = functools.partial(
            self.tokenizer.prompt_ids,
            None,
            plain_contents=self.plain_contents,
            options=options,
            generation=chat.add_generation_prompt,
            open_end=chat.continue_final_message,
            special=chat.add_special_tokens,
        )
        return [make(conversation) for conversation in chat.conversations]

    def abort(self, request_id: str) -> None:
        """Aborts a request on the engine, in the background (best effort)."""

        async def send() -> None:
            abort = pb.AbortRequest(request_ids=[request_id])
            with contextlib.suppress(grpc.RpcError):  # the call's cancel reaches it as well
                await self.stub.Abort(abort, timeout=ABORT_TIMEOUT)

        task = asyncio.get_running_loop().create_task(send())
        _ABORTS.add(task)
        task.add_done_callback(_ABORTS.discard)

    async def watch_health(self, poll_interval: float, deadline: float) -> AsyncIterator[bool]:
        """Serving when both its grpc.health.v1 and its own HealthCheck say so,
        every `poll_interval`; a `GatewayError` when it cannot be reached."""
        request = health_pb2.HealthCheckRequest(service="")
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            try:
                reply = await self._health.Check(  # type: ignore[attr-defined]
                    request, timeout=deadline
                )
                engine = await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=deadline)
            except grpc.RpcError as error:
                self._server_info = None  # what comes back may be restarted otherwise
                raise _from_rpc_error(error) from None
            yield reply.status == serving and engine.healthy
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Closes the channels, cancelling calls still on them."""
        if self._streams is not None:
            await self._streams.close()
        await self._channel.close()
