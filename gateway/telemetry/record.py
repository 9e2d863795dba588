"""The running tally of one request: what the edge has written so far (tokens,
timings, the worker's counts), read once at the end by the metrics and the
access log, and while it runs by a team's token billing.

`take` is on the token path: one call per written batch, no allocation beyond
the joined text, and at most one histogram observation. A request for n
choices is `finished` at the last of its n `Finished` events; its completion
tokens are their counts summed, and tool calls' tokens count as sent.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.protocol.errors import Outcome
from gateway.protocol.types import Event, Finished, Started, Text, ToolCallDelta


class RequestRecord:
    """One request as it goes: filled by the edge, read once at the end."""

    __slots__ = (
        "asked",
        "cache_hit_blocks",
        "choices_left",
        "completion_tokens",
        "finished",
        "first_token_at",
        "granted_tokens",
        "itl",
        "last_token_at",
        "model",
        "outcome",
        "policy",
        "prompt",
        "prompt_tokens",
        "reason",
        "request_id",
        "route",
        "started_at",
        "status",
        "stream",
        "tokens_sent",
        "worker",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        #: The API route that served it, as a bounded label (`/v1/chat/completions`,
        #: `/v2/models/{model}/infer`...); "" where none set it.
        self.route = ""
        self.started_at = time.perf_counter()
        self.model = ""
        #: The model the request named, when another served it (an alias's target, a
        #: fallback); "" otherwise.
        self.asked = ""
        self.stream = False
        self.worker = ""
        self.status = 0
        self.outcome: Outcome | None = None
        self.reason = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tokens_sent = 0  # completion tokens written so far (a team's limits read it)
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.finished: Finished | None = None  # the last choice's, once all have finished
        self.choices_left = 1
        self.prompt: Any = None
        self.itl: Any = None  # the model's inter-token-latency histogram child
        #: The routing decision (`models[].routing`): its policy ("" without routing)
        #: and the prefix blocks the picked worker held.
        self.policy = ""
        self.cache_hit_blocks: int | None = None
        #: Completion tokens per choice a team's tokens per minute granted a request that
        #: set no bound (the worker is given it as max_tokens); None: no such grant.
        self.granted_tokens: int | None = None

    def expect(self, choices: int) -> None:
        """The request asks for `choices` answers: it ends after as many `Finished`."""
        self.choices_left = choices

    def take(self, batch: list[Event]) -> str:
        """Records a batch of events as it is written; returns its text, joined
        (of every choice: the one-choice path writes it, the others ignore it)."""
        pieces = []
        tokens = 0
        for event in batch:
            if type(event) is Text:
                pieces.append(event.text)
                tokens += event.tokens
            elif isinstance(event, ToolCallDelta):
                tokens += event.tokens
            elif isinstance(event, Started):
                self.prompt_tokens = event.prompt_tokens
            elif isinstance(event, Finished):
                self.completion_tokens += event.completion_tokens
                if event.prompt_tokens is not None:
                    self.prompt_tokens = event.prompt_tokens
                self.choices_left -= 1
                if self.choices_left <= 0:
                    self.finished = event
        if tokens:
            self.tokens_sent += tokens
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.itl is not None:
                self.itl.observe((now - self.last_token_at) / tokens)
            self.last_token_at = now
        return "".join(pieces)
