"""Token ids handed to an answer's events by the tokens each counts (vLLM's
`return_token_ids`): what an engine, or the gateway for vLLM's gRPC server, knows as
the ids it sampled, in order, while its events (after a tool-call parser, a reasoning
splitter, stop strings) each count a share of them. Used only for requests that ask.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.protocol.types import Event, Finished


class IdsByCount:
    """An engine's sampled token ids handed to its events by their counts (vLLM's
    `return_token_ids`): each `Text`, `Reasoning` or `ToolCallDelta` takes the next
    `tokens` of the ids `add` gave, in order, and a `Finished` those left (the end of
    sequence, or text no event released), so a choice's events' ids joined are every
    token it generated, whatever its tool-call parser made of them."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: list[int] = []

    def add(self, ids: Sequence[int]) -> None:
        """Ids sampled, in order, before the events that count them."""
        self._ids.extend(ids)

    def attach(self, events: list[Event]) -> list[Event]:
        """`events` (of one choice), each with its ids."""
        out: list[Event] = []
        for event in events:
            take = len(self._ids) if type(event) is Finished else event.tokens  # type: ignore[union-attr]
            ids, self._ids = self._ids[:take], self._ids[take:]
            out.append(event._replace(token_ids=tuple(ids)))  # type: ignore[call-arg]
        return out
