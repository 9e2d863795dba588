"""An engine that yields the events (or raises the errors) a test hands it: the
worker SDK's tests drive its protocol handling with it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.protocol.types import Event, GenerateRequest
from gateway.worker import Engine


class ScriptEngine(Engine):
    """Yields the events (or raises the errors) a test hands it."""

    model = "script-engine"
    max_context = 100

    def __init__(self, events: list, capacity: int = 256) -> None:
        self.events = events
        self.capacity = capacity

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        for event in self.events:
            if isinstance(event, Exception):
                raise event
            yield event
