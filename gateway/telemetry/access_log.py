"""One JSON line per request on the `furnace.access` logger: who asked what of
which worker, how it ended, and how long it took. Prompts only with
`log_prompts`; completions and keys never."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from gateway.protocol.errors import Outcome
from gateway.telemetry.record import RequestRecord

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
        if record.policy:  # routed on the engines' state: why this worker
            line["policy"] = record.policy
            line["cache_hit_blocks"] = record.cache_hit_blocks
        if self.log_prompts and record.prompt is not None:
            line["prompt"] = record.prompt
        access_log.info(orjson.dumps(line).decode())
