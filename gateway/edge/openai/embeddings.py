"""`POST /v1/embeddings`, as OpenAI's API and vLLM's server answer it: read and check the
body, find the model (it must list "embeddings" in its workers' features), admit it like a
generation (drain, team limits, a slot), call a worker (`fleet/embedding.py`), and answer
`{"object": "list", "data": [...], "model", "usage"}` with the vectors as JSON floats or,
with `encoding_format: base64`, as little-endian float32 bytes in base64 (what the openai
SDK asks for by default).

Inputs: a string, a list of strings, a list of token ids or a list of lists of token ids;
at most 2048 of them, no empty one, ids in the worker protocol's uint32; the body's size is
`max_body_bytes`'. Or vLLM's chat form: `messages`, one conversation (checked as a chat
completion's) or a list of them (vLLM's batched form, at most 2048), or a conversation
given as `input`, each rendered by the model's chat template (with `add_generation_prompt`,
`continue_final_message`, `add_special_tokens`, `chat_template_kwargs`) and embedded as
one input; served by models that list `embeddings.messages` (OpenAI-compatible servers,
which render it themselves, and `vllm-grpc`, where the gateway renders it; the worker
protocol's `Embed` takes texts and ids only). `dimensions` and `user` go to workers that
list them, else a 400 names them. A client that goes away cancels the worker's call,
`request_timeout` bounds the whole call, and the request leaves one record in the metrics
and the access log (its inputs' tokens as prompt tokens, which a team's tokens per minute
are charged once known).

A model's `fallbacks` serve its embeddings as they serve a generation (admission: every
worker full, the queue refusing, every worker tried failing; a fallback whose workers do
not serve embeddings, or the `dimensions` or `user` asked, is passed over): the answer's
`model` and its `x-furnace-model` header name the model that served.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson

from gateway.edge.asgi import send_json
from gateway.edge.errors import APIError, invalid
from gateway.edge.openai.body import read_json
from gateway.edge.openai.validation import (
    UINT32_MAX,
    _flag,
    _unserved,
    chat_messages,
    model_of,
    template_kwargs,
)
from gateway.edge.request import Exchange, RequestRoute, priority
from gateway.fleet import ModelPool
from gateway.fleet.embedding import embed
from gateway.protocol import features
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.protocol.types import ChatForm, Embeddings, EmbedRequest, Message, Pooling
from gateway.telemetry import RequestRecord
from gateway.telemetry.tracing import annotate

#: OpenAI's bound on the inputs of one request.
MAX_INPUTS = 2048
#: The most floats of an answer's vectors made into its body on the event loop (more, in a
#: thread: the loop then serves other requests between the thread's turns of the GIL).
INLINE_FLOATS = 256 * 1024
#: As `user` on the generation routes.
MAX_USER_CHARS = 256
#: The CLIENT span's name for a worker call: the gRPC method it is.
EMBED = "furnace.engine/Embed"

_INPUT_TYPES = (
    "Invalid type for 'input': expected a string, a list of strings, a list of token ids "
    "or a list of lists of token ids."
)


@dataclass(frozen=True, slots=True)
class EmbeddingsBody:
    """A valid body: what to embed, and how to answer."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool
    dimensions: int | None
    user: str
    #: The chat form's conversations and options (then no `inputs`); None: the text form.
    chat: ChatForm | None = None

    def answer(self, model: str, result: Pooling) -> bytes:
        """The response body, of the model that served."""
        assert isinstance(result, Embeddings)  # no model scores an embeddings request
        return answer(model, result, self.base64)


class Pooled(Protocol):
    """A checked body the embeddings' route serves: what to embed, and the answer made of
    the vectors (the embeddings themselves, or scores of them: scoring.py), of the scores
    a cross-encoder gave, or of a classifier's classes (classify.py)."""

    @property
    def inputs(self) -> tuple[str | tuple[int, ...], ...]: ...
    @property
    def dimensions(self) -> int | None: ...
    @property
    def user(self) -> str: ...
    @property
    def chat(self) -> ChatForm | None: ...
    def answer(self, model: str, result: Pooling) -> bytes: ...


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value: list[Any], where: str) -> tuple[int, ...]:
    if not value:
        raise invalid("input", f"Invalid value for 'input'{where}: an empty list of token ids.")
    if not all(_is_int(v) and 0 <= v <= UINT32_MAX for v in value):
        raise invalid(
            "input", f"Invalid value for 'input'{where}: token ids are integers in [0, 2^32)."
        )
    return tuple(value)


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """The inputs, each a text or token ids, or a 400 naming `input`."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list) or not value:
        raise invalid("input", _INPUT_TYPES if value != [] else "'input' is an empty list.")
    elif all(_is_int(v) for v in value):
        return (_token_ids(value, ""),)
    if len(value) > MAX_INPUTS:
        raise invalid("input", f"Invalid value for 'input': at most {MAX_INPUTS} inputs.")
    if all(isinstance(v, str) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            where = "" if len(value) == 1 else f"[{empty}]"
            raise invalid("input", f"Invalid value for 'input'{where}: an empty string.")
        return tuple(value)
    if all(isinstance(v, list) for v in value):
        return tuple(_token_ids(v, f"[{i}]") for i, v in enumerate(value))
    raise invalid("input", _INPUT_TYPES)


#: vLLM's embedding parameters not served, with the value that asks nothing of them.
UNSERVED_EMBEDDINGS: dict[str, Any] = {
    "truncate_prompt_tokens": None,
    "normalize": True,
    "embed_dtype": "float32",
    "add_special_tokens": True,
    "priority": 0,
    # vLLM 0.32's newer pooling options, and its ids
    "truncation_side": None,
    "use_activation": None,
    "mm_processor_kwargs": None,
    "cache_salt": None,
    "request_id": None,
}


def chat_unserved(unserved: dict[str, Any]) -> dict[str, Any]:
    """A route's options not served in its chat form: its text form's but
    `add_special_tokens` (the chat form's default is false, and true is served), and a
    client's own template and media options."""
    kept = {name: value for name, value in unserved.items() if name != "add_special_tokens"}
    return {**kept, "chat_template": None, "media_io_kwargs": None}


UNSERVED_CHAT_EMBEDDINGS = chat_unserved(UNSERVED_EMBEDDINGS)
#: The chat form's options: with the text form, a 400 (they would change nothing).
_CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def parse_embeddings(body: Any) -> EmbeddingsBody:
    """The body checked, or a 400 naming the parameter at fault. Unknown fields are
    ignored, as on the generation routes."""
    model = model_of(body)
    chat = chat_form(body)
    if chat is None:
        _unserved(body, UNSERVED_EMBEDDINGS)
        if "input" not in body:
            raise invalid("input", "Missing required parameter: 'input'.")
        inputs = _inputs(body["input"])
    else:
        _unserved(body, UNSERVED_CHAT_EMBEDDINGS)
        inputs = ()
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise invalid(
            "encoding_format", "Invalid value for 'encoding_format': 'float' or 'base64'."
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and not (_is_int(dimensions) and 1 <= dimensions <= UINT32_MAX):
        raise invalid("dimensions", "Invalid value for 'dimensions': an integer of at least 1.")
    return EmbeddingsBody(model, inputs, encoding == "base64", dimensions, user_of(body), chat)


def chat_form(body: Mapping[str, Any], *, embeddings: bool = True) -> ChatForm | None:
    """vLLM's chat form of the body (`messages`; for `embeddings` also a batch of
    conversations, or a conversation as `input`, which vLLM's classification reads not),
    checked; None for the text form, which takes none of its options."""
    messages: Any = body.get("messages")
    where = "messages"
    if messages is None:
        value = body.get("input")
        conversation = isinstance(value, list) and value and all(isinstance(v, dict) for v in value)
        if not (embeddings and conversation):
            for name in _CHAT_OPTIONS:
                if body.get(name) not in (None, False, {}):
                    raise invalid(name, f"'{name}' is an option of the chat form: 'messages'.")
            return None
        messages, where = value, "input"  # vLLM reads a list of messages as a conversation
    elif "input" in body:
        raise invalid("input", "Give 'input' or 'messages', not both.")
    batched = isinstance(messages, list) and bool(messages)
    batched = batched and all(isinstance(c, list) for c in messages)
    if batched and not embeddings:
        raise invalid("messages", "Invalid value for 'messages': one conversation.")
    if batched and len(messages) > MAX_INPUTS:
        raise invalid(where, f"Invalid value for '{where}': at most {MAX_INPUTS} conversations.")
    conversations = (
        tuple(_conversation(c, f"{where}[{k}]") for k, c in enumerate(messages))
        if batched
        else (_conversation(messages, where),)
    )
    generation = _flag(body, "add_generation_prompt")
    open_end = _flag(body, "continue_final_message")
    if generation and open_end:
        raise invalid(
            "continue_final_message",
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
        )
    return ChatForm(
        conversations,
        batched,
        generation,
        open_end,
        _flag(body, "add_special_tokens"),
        template_kwargs(body),
    )


def _conversation(value: Any, where: str) -> tuple[Message, ...]:
    """One conversation, checked as a chat's `messages`, its refusals naming `where`."""
    try:
        return chat_messages(value)
    except APIError as error:
        if where != "messages":
            if error.param is not None and error.param.startswith("messages"):
                error.param = where + error.param.removeprefix("messages")
            error.message = error.message.replace("'messages", f"'{where}")
        raise


def user_of(body: Mapping[str, Any]) -> str:
    """The body's `user` (sent to workers that list it), or a 400 naming it."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "Invalid type for 'user': expected a string.")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise invalid("user", f"Invalid value for 'user': at most {MAX_USER_CHARS} characters.")
    return user or ""


def check_served(pool: ModelPool, request: EmbedRequest) -> None:
    """Refuses, naming the parameter, what the model's workers do not serve; when none
    has described itself yet, the worker refuses for itself (but media in a conversation
    the gateway would render: only an OpenAI-compatible server takes them)."""
    served = pool.features()
    if served is None:
        if request.chat is not None and not pool.relays_answers:
            _check_media(pool, request.chat, frozenset())
        return
    if features.EMBEDDINGS not in served:
        raise invalid("model", f"The model `{pool.name}` does not serve embeddings.")
    if request.chat is not None:
        if features.EMBEDDING_CHAT not in served:
            raise invalid(
                "messages",
                f"The model `{pool.name}` embeds texts and token ids only, not conversations: "
                "its workers cannot render a chat template.",
            )
        _check_media(pool, request.chat, served)
    for feature, asked in (
        (features.DIMENSIONS, request.dimensions is not None),
        (features.USER, bool(request.user)),
    ):
        if asked and feature not in served:
            raise invalid(feature, f"The model `{pool.name}` does not support '{feature}'.")


def _check_media(pool: ModelPool, chat: ChatForm, served: frozenset[str]) -> None:
    """Refuses an image, a sound or a video in the chat form's conversations where the
    workers take none (the gateway's own rendering, `vllm-grpc`, takes none: it would be
    dropped), naming the message."""
    for k, conversation in enumerate(chat.conversations):
        where = f"messages[{k}]" if chat.batched else "messages"
        for i, message in enumerate(conversation):
            media = [features.IMAGES] if message.images else []
            media += [features.RELAYED_PARTS.get(part.type, "") for part in message.parts]
            for feature in media:
                if feature and feature not in served:
                    raise invalid(
                        f"{where}[{i}].content",
                        f"The model `{pool.name}` does not support '{feature}'.",
                    )


def _vector(values: tuple[float, ...], as_base64: bool) -> tuple[float, ...] | str:
    if not as_base64:
        return values  # orjson writes a tuple as an array
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def answer(model: str, embeddings: Embeddings, as_base64: bool) -> bytes:
    """The response body."""
    tokens = embeddings.prompt_tokens
    return orjson.dumps(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _vector(vector, as_base64)}
                for i, vector in enumerate(embeddings.vectors)
            ],
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


class EmbeddingsRoute(RequestRoute[Exchange]):
    """`POST /v1/embeddings` over the gateway's parts, as a raw ASGI endpoint in the edge's
    request frame (request.py)."""

    exchange = Exchange
    #: The CLIENT span of the workers' call, and what a timeout names.
    span = EMBED
    what = "The embeddings"

    def _usage(self, record: RequestRecord) -> dict[str, Any]:
        return {"gen_ai.usage.input_tokens": record.prompt_tokens}

    def parse(self, body: Any) -> Pooled:
        """The body read into what to embed and how to answer (a 400 naming the
        parameter)."""
        return parse_embeddings(body)

    def check(self, pool: ModelPool, request: EmbedRequest) -> None:
        """Refuses what the model's workers do not serve (a 400 naming it)."""
        check_served(pool, request)

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the body, admits it through admission's stages (a queued
        client that leaves, leaves the queue at once), calls a worker and answers."""
        ctx, record = ex.ctx, ex.record
        admission = self.admission
        meter = admission.before_body(ctx)
        body = await read_json(ex.scope, ex.receive, self.config.max_body_bytes, meter)
        ctx.fallbacks = True  # it serves on `ctx.pool`, which a fallback may change
        pool = admission.visibility(ctx, model_of(body))
        parsed = self.parse(body)
        chat = parsed.chat
        request = EmbedRequest(
            pool.name, parsed.inputs, parsed.dimensions, parsed.user, record.request_id, chat
        )
        if self.telemetry.log_prompts:
            record.prompt = list(parsed.inputs) if chat is None else list(chat.conversations)
        self.check(pool, request)
        ctx.request = request
        ctx.priority = priority(ex)
        ex.watch_client()  # from here: a client that leaves while queued leaves the queue
        async with admission.admit(ctx):
            result = await self._call(ctx.pool or pool, request, parsed, ex)
        vectors = result.vectors if isinstance(result, Embeddings) else ()
        if vectors and len(vectors) * len(vectors[0]) > INLINE_FLOATS:
            # scoring 2,048 vectors of 1,024 floats took 0.36 s of Python: not on the loop
            body_bytes = await asyncio.to_thread(parsed.answer, record.model, result)
        else:
            body_bytes = parsed.answer(record.model, result)
        record.status, record.outcome = 200, Outcome.COMPLETED
        headers = [
            (b"x-furnace-model", record.model.encode("latin-1")),
            (b"x-request-id", record.request_id.encode("latin-1")),
        ]
        await send_json(ex.send, 200, body_bytes, headers)

    def work(
        self,
        pool: ModelPool,
        request: EmbedRequest,
        parsed: Pooled,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
    ) -> Awaitable[tuple[Pooling, str]]:
        """The call on one model's workers that answers `parsed` (`request` named for
        `pool`), and the worker that served: their embeddings."""
        return embed(self.fleet, pool, request, deadline, metadata)

    async def _call(
        self, pool: ModelPool, request: EmbedRequest, parsed: Pooled, ex: Exchange
    ) -> Pooling:
        """The workers' answer (`work`), from `pool` or, when it cannot answer, its
        fallbacks (`Admission.on_fallbacks`, as a generation's start); cancelled when the
        client leaves, the drain ends it or `request_timeout` passes."""
        record = ex.record
        timeout = self.config.request_timeout
        deadline = Deadline(timeout)
        with self.tracing.engine_call(pool.name, ex.metadata, self.span) as (span, metadata):

            def call(served: ModelPool) -> Awaitable[tuple[Pooling, str]]:
                named = request if served is pool else replace(request, model=served.name)
                return self.work(served, named, parsed, deadline, metadata)

            work = self.admission.on_fallbacks(ex.ctx, deadline, call)
            result, record.worker = await self.admission.unary(ex.ctx, work, timeout, self.what)
            annotate(span, {"furnace.worker": record.worker})
        record.prompt_tokens = result.prompt_tokens
        return result
