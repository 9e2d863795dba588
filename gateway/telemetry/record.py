"""The running tally of one request: what the edge has written so far (tokens,
timings, the worker's counts), read once at the end by the metrics and the
access log, and while it runs by a team's token billing.

`take` (`take_texts` for the pump's sink) is on the token path: one call per written
batch, no allocation beyond the joined text (and the batch's kinds of events, with which
its texts are picked out and counted in C rather than in a loop in Python); its
inter-token gap joins a list, observed into the histogram `ITL_BATCH` at a time and at
the request's end (prometheus-client's `observe` walks the buckets in Python and takes two
locks: 2-3 % of the vllm-grpc path's CPU when it ran every write). A request for n choices
is `finished` at the last of its n `Finished` events; its completion tokens are their
counts summed, and tool calls' tokens count as sent.
"""

from __future__ import annotations

import time
from itertools import compress, repeat
from operator import attrgetter, is_, is_not
from typing import Any, Protocol

from gateway.protocol.errors import Outcome
from gateway.protocol.types import Event, Finished, Reasoning, Started, Text, ToolCallDelta

#: Inter-token gaps a record keeps before it observes them in one go (a long answer's
#: figures reach the histogram as it goes, not only at its end).
ITL_BATCH = 64

#: A batch's kinds of events when it holds texts alone; their text and tokens.
_TEXTS = frozenset({Text})
_text = attrgetter("text")
_tokens = attrgetter("tokens")


class Observer(Protocol):
    """A histogram that takes many observations in one call."""

    def observe_all(self, samples: list[float]) -> None: ...


class RequestRecord:
    """One request as it goes: filled by the edge, read once at the end."""

    # Its fields start as class attributes, so a request's record is made with the few
    # that differ (every request makes one); each is set on the record when it changes.
    #: The API route that served it, as a bounded label (`/v1/chat/completions`,
    #: `/v2/models/{model}/infer`...); "" where none set it.
    route = ""
    #: Whose request it is, on a keyed gateway: the key's team, and the key's id
    #: (a digest, never the key); "" on an open one.
    team = ""
    key_id = ""
    model = ""
    #: The model the request named, when another served it (an alias's target, a
    #: fallback); "" otherwise.
    asked = ""
    stream = False
    worker = ""
    #: The worker that prefilled its prompt (`models[].prefill_workers`); "": none.
    prefill_worker = ""
    status = 0
    outcome: Outcome | None = None
    reason = ""
    prompt_tokens = 0
    #: Of the prompt's tokens, those the engine found in its prefix cache (its word, in
    #: `Started` or at the end in `Finished`); reported, never billed apart.
    cached_tokens = 0
    completion_tokens = 0
    tokens_sent = 0  # completion tokens written so far (a team's limits read it)
    first_token_at: float | None = None
    last_token_at = 0.0
    finished: Finished | None = None  # the last choice's, once all have finished
    choices_left = 1
    prompt: Any = None
    itl: Observer | None = None  # the model's inter-token-latency histogram
    #: The routing decision (`models[].routing`): its policy ("" without routing)
    #: and the prefix blocks the picked worker held.
    policy = ""
    cache_hit_blocks: int | None = None
    #: Of a routed model's prefill worker (`prefill_workers`): the prefix blocks it held.
    prefill_cache_hit_blocks: int | None = None
    #: Completion tokens per choice a team's tokens per minute granted a request that
    #: set no bound (the worker is given it as max_tokens); None: no such grant.
    granted_tokens: int | None = None

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started_at = time.perf_counter()
        self.gaps: list[float] = []  # inter-token gaps not observed yet

    def expect(self, choices: int) -> None:
        """The request asks for `choices` answers: it ends after as many `Finished`."""
        self.choices_left = choices

    def take(self, batch: list[Event]) -> str:
        """Records a batch of events as it is written; returns its text, joined
        (of every choice: the one-choice path writes it, the others ignore it; not
        the reasoning, whose tokens it counts)."""
        # Texts are picked out and counted in C: a loop in Python costs ~20 bytecodes an
        # event, and a fast engine's batch holds a text a token (over gRPC).
        tokens = 0
        if set(map(type, batch)) == _TEXTS:  # texts alone, as most of a stream's batches
            texts = batch
        else:  # the others, in order, in Python: ends, a start, tool calls' pieces
            kinds = list(map(type, batch))
            texts = list(compress(batch, map(is_, kinds, repeat(Text))))
            for event in compress(batch, map(is_not, kinds, repeat(Text))):
                if isinstance(event, Finished):
                    self.completion_tokens += event.completion_tokens
                    if event.prompt_tokens is not None:
                        self.prompt_tokens = event.prompt_tokens
                    if event.cached_tokens is not None:
                        self.cached_tokens = event.cached_tokens
                    self.choices_left -= 1
                    if self.choices_left <= 0:
                        self.finished = event
                elif isinstance(event, Started):
                    self.prompt_tokens = event.prompt_tokens
                    self.cached_tokens = event.cached_tokens
                elif type(event) is ToolCallDelta or type(event) is Reasoning:
                    tokens += event.tokens
        tokens += sum(map(_tokens, texts))
        if tokens:
            self._sent(tokens)
        return "".join(map(_text, texts))

    def take_texts(self, texts: list[Event]) -> None:
        """Records a batch of `Text`s (and `Reasoning`) alone, as it is written (its
        text joined by the writer: the pump's sink)."""
        tokens: int = _tokens(texts[0]) if len(texts) == 1 else sum(map(_tokens, texts))
        if tokens:
            self._sent(tokens)

    def _sent(self, tokens: int) -> None:
        """`tokens` more completion tokens written now: the time to the first, the
        gap since the last."""
        self.tokens_sent += tokens
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.itl is not None:
            gaps = self.gaps
            gaps.append((now - self.last_token_at) / tokens)
            if len(gaps) >= ITL_BATCH:
                self.observe_gaps()
        self.last_token_at = now

    def used(self) -> tuple[int, int]:
        """The prompt and completion tokens the engine counted: the completion's
        tokens written, when the answer was cut (a client gone) before its `Finished`
        counted them. Ledger, metrics and log line all count these."""
        if self.finished is not None:
            return self.prompt_tokens, self.completion_tokens
        return self.prompt_tokens, max(self.completion_tokens, self.tokens_sent)

    def observe_gaps(self) -> None:
        """Observes the inter-token gaps kept so far (at the end, the rest)."""
        if self.gaps and self.itl is not None:
            self.itl.observe_all(self.gaps)
            self.gaps = []
