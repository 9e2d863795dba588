"""One JSON line per request on the `furnace.access` logger: who asked what of
which worker, how it ended, and how long it took. Prompts only with
`log_prompts`, their inline media (images' and videos' `data:` URIs, sounds' base64)
cut to their start and size, so a line stays the size of the prompt's text;
completions and keys never."""

from __future__ import annotations

import logging
from dataclasses import fields, is_dataclass
from typing import Any

import orjson

from gateway.protocol.errors import Outcome
from gateway.protocol.types import ContentPart, Message
from gateway.telemetry.record import RequestRecord

#: The characters of an inline medium a logged prompt keeps: its type, its start.
MEDIA_KEPT = 48

access_log = logging.getLogger("furnace.access")


class AccessLog:
    """Writes the access-log line of a finished request."""

    def __init__(self, log_prompts: bool) -> None:
        self.log_prompts = log_prompts

    def write(self, record: RequestRecord, end: float, ttft: float | None) -> None:
        """The request's line, once it is over (nothing built when the log is off)."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        prompt_tokens, completion_tokens = record.used()
        line: dict[str, Any] = {
            "request_id": record.request_id,
            "route": record.route,
            "model": record.model,
            "worker": record.worker,
            "stream": record.stream,
            "status": record.status,
            "outcome": record.outcome or Outcome.ENGINE_ERROR,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
            "prompt_tokens": prompt_tokens,
            "cached_tokens": record.cached_tokens,  # of the prompt's, from its prefix cache
            "completion_tokens": completion_tokens,
            "duration_ms": round((end - record.started_at) * 1000, 3),
        }
        if record.reason:  # a rejection's: which limit or stage refused it
            line["reason"] = record.reason
        if record.team:  # a keyed gateway's: whose request it was
            line["team"] = record.team
            line["key_id"] = record.key_id
        if record.asked:  # an alias, or a model a fallback served instead
            line["asked_model"] = record.asked
        if record.prefill_worker:  # disaggregated: the worker that prefilled the prompt
            line["prefill_worker"] = record.prefill_worker
            if record.prefill_cache_hit_blocks is not None:  # routed on its cache
                line["prefill_cache_hit_blocks"] = record.prefill_cache_hit_blocks
        if record.policy:  # routed on the engines' state: why this worker
            line["policy"] = record.policy
            line["cache_hit_blocks"] = record.cache_hit_blocks
        if self.log_prompts and record.prompt is not None:
            line["prompt"] = record.prompt
            text = orjson.dumps(line, default=_logged, option=orjson.OPT_PASSTHROUGH_DATACLASS)
            access_log.info(text.decode())
            return
        access_log.info(orjson.dumps(line).decode())


def _logged(value: Any) -> dict[str, Any]:
    """A prompt's message or content part as the log writes it: its fields, its inline
    media cut (`_cut`)."""
    if not is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"{type(value).__name__} is not in a prompt")
    out = {field.name: getattr(value, field.name) for field in fields(value)}
    if isinstance(value, Message):
        out["images"] = tuple(map(_cut, value.images))
    elif isinstance(value, ContentPart):
        out["url"], out["data"] = _cut(value.url), _cut(value.data)
    return out


def _cut(medium: str) -> str:
    """An inline medium (a `data:` URI, base64) cut to its first `MEDIA_KEPT` characters
    and its size; a URL, or anything as short, as it is."""
    if len(medium) <= MEDIA_KEPT or medium.startswith(("http://", "https://")):
        return medium
    return f"{medium[:MEDIA_KEPT]}... ({len(medium)} characters)"
