"""The interface a model runtime implements to become a worker."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from gateway.protocol import errors, features
from gateway.protocol.errors import TooLong
from gateway.protocol.types import Embeddings, EmbedRequest, Event, GenerateRequest
from gateway.worker.kv_events import KvPublisher


class Engine(ABC):
    """A model runtime, as the worker SDK drives it.

    `generate` yields `Started` first, then `Text` pieces (with `logprobs`, one
    per token, when the request asks for them) and `ToolCallDelta`s (a call's
    id and name first, then its arguments' JSON in pieces), then `Finished`
    (`TOOL_CALLS` after calls). It refuses a request by raising an
    `GatewayError` (`TooLong`, `Invalid`, `Busy`, ...) before yielding `Started`.
    When the call is cancelled, the SDK closes the generator (CancelledError or
    GeneratorExit at its current `await`/`yield`): free the request's resources
    in a `finally`. Stop strings are the SDK's job; `max_tokens` and the context
    are the engine's. A field the engine does not list in `features` never
    reaches it: the SDK refuses the request naming the parameter.
    """

    #: The model name requests use.
    model: str
    #: Prompt plus completion tokens the model holds.
    max_context: int
    #: Requests it runs at once; the SDK refuses more with RESOURCE_EXHAUSTED.
    capacity: int = 256
    #: What it serves beyond plain generation (`gateway.protocol.features`), for
    #: `Describe`; the SDK refuses a request using anything else, naming the
    #: parameter. The SDK adds "n" itself: it runs n generations of n=1 and
    #: indexes their events, unless the engine sets `native_n` (then `generate`
    #: gets n and indexes its own events, one Finished per choice).
    features: frozenset[str] = features.FIRST_VERSION
    native_n: bool = False

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        """The events of one answer."""

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeds the inputs (engines that list "embeddings")."""
        raise errors.Invalid(f"The model `{self.model}` does not serve embeddings.", param="model")

    async def count_tokens(self, request: GenerateRequest) -> int:
        """The tokens of the prompt `generate` would make of `request` (its text, or its
        messages and tools through the template), by the engine's own tokenizer."""
        raise errors.Invalid(f"The model `{self.model}` does not count tokens.", param="model")

    def kv_events(self) -> KvPublisher | None:
        """Its KV-cache events for `SubscribeKvEvents` (`gateway.worker.kv_events`), so
        gateways route by what it holds; None: it publishes none (UNIMPLEMENTED)."""
        return None

    # The life of an engine that comes up after its worker listens (vLLM loads for
    # seconds to minutes): the worker reports NOT_SERVING until `start` returns and
    # once `wait_dead` does. Engines that are up when constructed keep the defaults.

    async def start(self) -> None:
        """Brings the engine up; by default it is up already."""
        return

    async def wait_dead(self) -> None:
        """Returns when the engine has died for good; by default never."""
        await asyncio.get_running_loop().create_future()

    async def shutdown(self) -> None:
        """Frees the engine once its worker has stopped; by default nothing."""
        return

    def load(self) -> int | None:
        """Requests running in the engine by its own count, for `Describe`; None:
        the worker counts the calls it is serving."""
        return None


def check_context(request: GenerateRequest, prompt_tokens: int, max_context: int) -> int:
    """Refuses a prompt (plus max_tokens) that does not fit, in vLLM's words, as
    `TooLong`; returns how many tokens the answer may take."""
    max_tokens = request.sampling.max_tokens
    wanted = prompt_tokens + (max_tokens or 0)
    if prompt_tokens >= max_context or wanted > max_context:
        raise TooLong(
            f"This model's maximum context length is {max_context} tokens. However, "
            f"you requested {wanted} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="messages" if request.messages is not None else "prompt",
        )
    budget = max_context - prompt_tokens
    return budget if max_tokens is None else min(budget, max_tokens)
