"""The interface a model runtime implements to become a worker."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from gateway.types import Event, GenerateRequest


class Engine(ABC):
    """A model runtime, as the worker SDK drives it.

    `generate` yields `Started` first, then `Text` pieces, then `Finished`.
    It refuses a request by raising an `EngineError` (`TooLong`, `Invalid`,
    `Busy`, ...) before yielding `Started`. When the call is cancelled, the SDK
    closes the generator (CancelledError or GeneratorExit at its current
    `await`/`yield`): free the request's resources in a `finally`.
    Stop strings are the SDK's job; `max_tokens` and the context are the engine's.
    """

    #: The model name requests use.
    model: str
    #: Prompt plus completion tokens the model holds.
    max_context: int
    #: Requests it runs at once; the SDK refuses more with RESOURCE_EXHAUSTED.
    capacity: int = 256

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The events of one answer."""
