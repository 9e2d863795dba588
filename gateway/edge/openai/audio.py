"""`POST /v1/audio/transcriptions` and `POST /v1/audio/translations`, as OpenAI's API and
vLLM's server answer them for a speech-to-text model (Whisper and the like): an audio
file, as a form (multipart/form-data, what the openai SDK sends), written down in its own
language, or translated into English.

The form is read whole, at most `max_audio_bytes` of file (OpenAI's 25 MB by default; a
larger one is a 413 before it is read) and counted against the bodies being read; its
fields are checked here, each named in its 400: `file` (one, not empty), `model`,
`language`, `prompt`, `response_format` (`json`, `text`, `srt`, `verbose_json`, `vtt`,
`diarized_json`: the server answers those it makes), `temperature` [0, 1],
`timestamp_granularities[]` (`word`, `segment`), `stream`, and vLLM's sampling fields
(`top_p`, `top_k`, `min_p`, `seed`, the penalties, `max_completion_tokens`,
`to_language`, `stream_include_usage`). OpenAI's options the servers do not read
(`include[]`, `chunking_strategy`, the known speakers) and any other field are refused
by name: a field a server would drop without a word is never sent to it.

Served by `upstream: openai` models (vLLM serving a Whisper model, OpenAI itself); others
are a 400 naming `model` (neither our worker protocol nor vLLM's gRPC server has an audio
call). Admitted as every request is (drain, team limits, a slot, `request_timeout`; the
audio's tokens are not known before the server reads it: limits and budgets weigh it as
one token, so a spent budget refuses it), one
record in the metrics and the access log, with the tokens the server said it read and
wrote (vLLM says a duration for a whole answer: none counted; a stream's usage, when
asked for with `stream_include_usage`, is counted).

A whole answer is the server's, as it made it, but that a `text` answer vLLM writes as
JSON becomes the text itself, `text/plain`, as OpenAI answers. With `stream=true` the
answer is OpenAI's stream of server-sent events, whichever stream the server speaks:
`{"type": "transcript.text.delta", "delta"}` for each piece, then
`{"type": "transcript.text.done", "text", "usage"}` (usage where the server gave it) and
`data: [DONE]`. Its status waits for the first piece (or the end), so a refusal is a
real 4xx/5xx; a failure after it is an error event, then `[DONE]`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.edge.errors import APIError, from_error, invalid, unknown_parameters
from gateway.edge.forms import FORM_SLACK, Form, read_form
from gateway.edge.openai.encoding import DONE, sse
from gateway.edge.request import Exchange, Parts, RequestRoute, priority
from gateway.fleet import ModelPool
from gateway.fleet.audio import transcribe
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.protocol.types import AudioRequest, Transcript
from gateway.telemetry import RequestRecord
from gateway.telemetry.tracing import annotate

TRANSCRIPTIONS = "/v1/audio/transcriptions"
TRANSLATIONS = "/v1/audio/translations"
#: The CLIENT span of the worker's call.
TRANSCRIBE = "furnace.engine/Transcribe"
#: What a body that is not a form is told.
EXPECTED = "Send the audio as multipart/form-data, with 'file' and 'model'."
#: The longest text field taken (a prompt: OpenAI's model reads its last 224 tokens).
MAX_FIELD_CHARS = 64 * 1024
#: The formats OpenAI's API and vLLM's server make between them.
FORMATS = frozenset({"json", "text", "srt", "verbose_json", "vtt", "diarized_json"})
GRANULARITIES = frozenset({"word", "segment"})
#: OpenAI's options that no OpenAI-compatible speech server reads (vLLM drops them).
UNSERVED = {
    "include[]": "logprobs of a transcript are not served",
    "chunking_strategy": "the servers cut the audio themselves",
    "known_speaker_names[]": "speakers are not served",
    "known_speaker_references[]": "speakers are not served",
}

_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def _number(low: float, high: float, low_open: bool = False) -> Callable[[str, str], str]:
    """A check of a number field within [low, high] (`low_open`: (low, high])."""

    def check(name: str, raw: str) -> str:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (low < value <= high if low_open else low <= value <= high):
            opening = "(" if low_open else "["
            raise invalid(name, f"Invalid value for '{name}': a number in {opening}{low}, {high}].")
        return raw

    return check


def _integer(low: int, high: int = 2**63 - 1) -> Callable[[str, str], str]:
    """A check of an integer field within [low, high]."""

    def check(name: str, raw: str) -> str:
        stripped = raw.strip()
        digits = stripped.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()) or not low <= int(stripped) <= high:
            raise invalid(name, f"Invalid value for '{name}': an integer from {low}.")
        return stripped

    return check


def _boolean(name: str, raw: str) -> str:
    if raw.strip().lower() not in ("true", "false"):
        raise invalid(name, f"Invalid value for '{name}': 'true' or 'false'.")
    return raw.strip().lower()


def _one_of(values: frozenset[str]) -> Callable[[str, str], str]:
    def check(name: str, raw: str) -> str:
        if raw not in values:
            shown = ", ".join(sorted(values))
            raise invalid(name, f"Invalid value for '{name}': one of {shown}.")
        return raw

    return check


def _text(name: str, raw: str) -> str:
    if len(raw) > MAX_FIELD_CHARS:
        raise invalid(name, f"Invalid value for '{name}': at most {MAX_FIELD_CHARS} characters.")
    return raw


#: The fields sent on to the server, each with its check (which gives the value sent).
FIELDS: dict[str, Callable[[str, str], str]] = {
    "language": _text,
    "to_language": _text,
    "prompt": _text,
    "response_format": _one_of(FORMATS),
    "temperature": _number(0.0, 1.0),
    "timestamp_granularities[]": _one_of(GRANULARITIES),
    "stream": _boolean,
    "stream_include_usage": _boolean,
    "top_p": _number(0.0, 1.0, low_open=True),
    "top_k": _integer(-1),
    "min_p": _number(0.0, 1.0),
    "seed": _integer(-(2**63)),
    "frequency_penalty": _number(-2.0, 2.0),
    "presence_penalty": _number(-2.0, 2.0),
    "repetition_penalty": _number(0.0, 2.0, low_open=True),
    "max_completion_tokens": _integer(1),
}


@dataclass(frozen=True, slots=True)
class AudioBody:
    """A valid form: the fields sent on, and whether it streams."""

    fields: tuple[tuple[str, str], ...]
    stream: bool


def parse_audio(form: Form, max_bytes: int) -> AudioBody:
    """The form checked (but its model, looked up first), or a 4xx naming the field at
    fault."""
    if not form.files:
        raise invalid("file", "Missing required parameter: 'file'.")
    if form.files > 1:
        raise invalid("file", "Send one audio file a request.")
    if not form.file:
        raise invalid("file", "Invalid value for 'file': the file is empty.")
    if len(form.file) > max_bytes:
        raise APIError(
            413, f"The file is larger than {max_bytes} bytes.", param="file", code="file_too_large"
        )
    for name, reason in UNSERVED.items():
        if name in form.fields:
            raise invalid(name, f"'{name}' is not supported: {reason}.")
    unknown_parameters(form.fields, {"model", *FIELDS})
    fields: list[tuple[str, str]] = []
    for name, values in form.fields.items():
        if name == "model":
            continue
        if len(values) > 1 and name != "timestamp_granularities[]":
            raise invalid(name, f"Invalid value for '{name}': sent more than once.")
        for raw in values:
            try:
                text = raw.decode()
            except UnicodeDecodeError:
                raise invalid(name, f"Invalid value for '{name}': not UTF-8.") from None
            fields.append((name, FIELDS[name](name, text)))
    stream = ("stream", "true") in fields
    return AudioBody(tuple(fields), stream)


class AudioRoute(RequestRoute[Exchange]):
    """`POST /v1/audio/transcriptions` (or `/translations`: `translate`) over the
    gateway's parts, as a raw ASGI endpoint in the edge's request frame (request.py)."""

    exchange = Exchange

    def __init__(self, parts: Parts, translate: bool) -> None:
        super().__init__(parts)
        self.translate = translate

    def _usage(self, record: RequestRecord) -> dict[str, Any]:
        return {
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
        }

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the form, admits it, calls a worker and answers (whole, or
        streamed as the worker's text comes)."""
        ctx, record = ex.ctx, ex.record
        admission, limit = self.admission, self.config.max_audio_bytes
        meter = admission.before_body(ctx)
        form = await read_form(ex.scope, ex.receive, limit + FORM_SLACK, meter, EXPECTED)
        ctx.fallbacks = True  # it serves on `ctx.pool`, which a fallback may change
        pool = admission.visibility(ctx, form.field("model"))
        body = parse_audio(form, limit)
        if not pool.relays_answers:
            raise invalid(
                "model",
                f"The model `{pool.name}` does not serve speech to text (only models of "
                "OpenAI-compatible servers, `upstream: openai`, do).",
            )
        request = AudioRequest(
            pool.name,
            self.translate,
            form.file,
            form.filename[:256],
            form.file_type[:128],
            body.fields,
            body.stream,
            record.request_id,
        )
        record.stream = body.stream
        ctx.request = request  # admission charges it one token, until the server says
        ctx.priority = priority(ex)
        ex.watch_client()  # from here: a client that leaves while queued leaves the queue
        stream = _Stream(ex) if body.stream else None
        async with admission.admit(ctx):
            transcript = await self._call(request, ex, stream)
        if transcript is None:
            return  # a stream broke after its head: said in it, and in the record
        record.prompt_tokens = transcript.prompt_tokens
        record.completion_tokens = transcript.completion_tokens
        record.status, record.outcome = 200, Outcome.COMPLETED
        if stream is not None:
            await stream.end(transcript)
            return
        headers = [
            (b"content-type", transcript.content_type.encode("latin-1")),
            (b"content-length", b"%d" % len(transcript.body)),
            *_ids(ex),
        ]
        await ex.send({"type": "http.response.start", "status": 200, "headers": headers})
        await ex.send({"type": "http.response.body", "body": transcript.body})

    async def _call(
        self, request: AudioRequest, ex: Exchange, stream: _Stream | None
    ) -> Transcript | None:
        """The worker's transcript, from the request's model or, when it cannot answer
        before any of it is sent, its fallbacks; cancelled when the client leaves, the
        drain ends it or `request_timeout` passes. A stream that broke after its head
        ends with an error event (None)."""
        ctx, record = ex.ctx, ex.record
        timeout = self.config.request_timeout
        deadline = Deadline(timeout)
        pool = ctx.pool
        assert pool is not None
        on_text = None if stream is None else stream.text
        with self.tracing.engine_call(pool.name, ex.metadata, TRANSCRIBE) as (span, metadata):

            def call(served: ModelPool) -> Awaitable[tuple[Transcript, str]]:
                named = request if served is pool else replace(request, model=served.name)
                return transcribe(self.fleet, served, named, deadline, metadata, on_text)

            work = self.admission.on_fallbacks(ctx, deadline, call)
            try:
                transcript, record.worker = await self.admission.unary(
                    ctx, work, timeout, "The transcription"
                )
            except errors.GatewayError as error:
                if stream is None or not stream.started:
                    raise
                await stream.fail(from_error(error, None, record.request_id), record)
                return None
            annotate(span, {"furnace.worker": record.worker})
        return transcript


def _ids(ex: Exchange) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-furnace-model", ex.record.model.encode("latin-1")),
        (b"x-request-id", ex.record.request_id.encode("latin-1")),
    ]


class _Stream:
    """A streamed answer to one client: its head with the first text (or the end), each
    text a `transcript.text.delta` event, then the `transcript.text.done` event."""

    def __init__(self, ex: Exchange) -> None:
        self._ex = ex
        self.started = False

    async def _start(self) -> None:
        self.started = True
        self._ex.record.status = 200
        headers = [*_HEADERS, *_ids(self._ex)]
        await self._ex.send({"type": "http.response.start", "status": 200, "headers": headers})

    async def _write(self, data: bytes, more: bool = True) -> None:
        if not self.started:
            await self._start()
        await self._ex.send({"type": "http.response.body", "body": data, "more_body": more})

    async def text(self, delta: str) -> None:
        """One piece of the transcript, sent (the first: the time to the first token)."""
        record = self._ex.record
        if record.first_token_at is None:
            record.first_token_at = time.perf_counter()
        await self._write(sse({"type": "transcript.text.delta", "delta": delta}))

    async def end(self, transcript: Transcript) -> None:
        """The whole text, its usage where known, and [DONE]."""
        done: dict[str, Any] = {"type": "transcript.text.done", "text": transcript.text}
        read, wrote = transcript.prompt_tokens, transcript.completion_tokens
        if read or wrote:
            done["usage"] = {
                "type": "tokens",
                "input_tokens": read,
                "output_tokens": wrote,
                "total_tokens": read + wrote,
            }
        await self._write(sse(done) + DONE, more=False)

    async def fail(self, error: APIError, record: RequestRecord) -> None:
        """A failure after the head: an error event and [DONE]; the record says so."""
        record.outcome, record.reason = error.outcome, error.reason
        await self._write(sse({"error": error.fields()}) + DONE, more=False)
