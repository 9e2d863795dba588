"""Speech to text on an OpenAI-compatible server, the one place that knows its answers'
shapes: the form sent (`form_of`), a whole answer read (`transcript_from`), and a
streamed one cut into texts (`TranscriptStream`), whichever of the two streams the
server speaks: vLLM's `transcription.chunk` chunks (a delta's `content` in `choices`,
the usage in a last chunk when asked with `stream_include_usage`), or OpenAI's
`transcript.text.delta` and `transcript.text.done` events.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocol import errors
from gateway.protocol.types import AudioRequest, Transcript
from gateway.upstreams.openai_http.sse import MAX_EVENT_BYTES
from gateway.upstreams.openai_http.translate import error_from_event

#: The most of a whole transcript read (a verbose_json of an hour's segments is a few MB).
MAX_TRANSCRIPT_BYTES = 16 * 1024 * 1024


def form_of(request: AudioRequest) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """httpx's `data` (each field's values, in order) and `files` for the request."""
    data: dict[str, list[str]] = {"model": [request.model]}
    for name, value in request.fields:
        data.setdefault(name, []).append(value)
    file = (request.filename or "audio", request.audio, request.content_type or None)
    return data, {"file": file}


def _tokens(usage: Any) -> tuple[int, int]:
    """The prompt's and the answer's tokens of a usage, in vLLM's names or OpenAI's (a
    duration's usage has none: 0, 0)."""
    if not isinstance(usage, dict):
        return 0, 0
    read = usage.get("prompt_tokens", usage.get("input_tokens"))
    wrote = usage.get("completion_tokens", usage.get("output_tokens"))
    counts = [n if type(n) is int and n >= 0 else 0 for n in (read, wrote)]
    return counts[0], counts[1]


def transcript_from(content_type: str, content: bytes, as_text: bool) -> Transcript:
    """A whole answer: as the server made it, but that a `text` answer the server wrote as
    JSON (vLLM's server does) becomes the text itself, as OpenAI's API answers it."""
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind != "application/json":  # text, srt, vtt: the text is the answer
        plain = content.decode("utf-8", "replace")
        return Transcript(content, content_type or "text/plain; charset=utf-8", plain)
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise errors.Failed("The upstream's transcript is not JSON.") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
        raise errors.Failed("The upstream's transcript has no text.")
    text: str = payload["text"]
    prompt, completion = _tokens(payload.get("usage"))
    if as_text:
        return Transcript(text.encode(), "text/plain; charset=utf-8", text, prompt, completion)
    return Transcript(content, "application/json", text, prompt, completion)


class TranscriptStream:
    """A streamed answer's bytes cut into its texts (`feed`), its whole text and its
    usage kept; `done` once the server said its stream is over."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.done = False
        self._rest = b""

    def feed(self, data: bytes) -> list[str]:
        """The texts `data` completes (an event longer than `MAX_EVENT_BYTES`, or an error
        event, raises)."""
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > MAX_EVENT_BYTES:
            raise errors.Failed("The upstream sent an event larger than the gateway takes.")
        texts: list[str] = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # an `event:` or `id:` line, a comment, the blank line between
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                event = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise errors.Failed("The upstream sent an event that is not JSON.") from None
            if isinstance(event, dict):
                self._event(event, texts)
        self.pieces += texts
        return texts

    def _event(self, event: dict[str, Any], texts: list[str]) -> None:
        if "error" in event:
            raise error_from_event(event)
        kind = event.get("type")
        if kind == "transcript.text.delta":
            delta = event.get("delta")
            if isinstance(delta, str) and delta:
                texts.append(delta)
        elif kind == "transcript.text.done":
            self.done = True
        if "usage" in event and event["usage"] is not None:
            self.prompt_tokens, self.completion_tokens = _tokens(event["usage"])
        for choice in event.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str) and content:
                texts.append(content)

    def transcript(self) -> Transcript:
        """What the stream said, once it is over."""
        text = "".join(self.pieces)
        return Transcript(b"", "", text, self.prompt_tokens, self.completion_tokens)
