"""The fleet: models, the workers that serve each, and which worker takes a request.

A request goes to the worker of its model with the fewest outstanding calls. A
retryable refusal before the worker's first event (busy, unreachable, model not
there) is tried once more on each other worker; after the first event nothing
is retried, since the client may already hold part of the answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

from gateway import errors
from gateway.admission import Deadline
from gateway.config import ModelConfig
from gateway.engine_client import EngineClient, EngineStream
from gateway.types import GenerateRequest, Started

log = logging.getLogger("furnace.fleet")

DESCRIBE_TIMEOUT = 2.0


@dataclass(eq=False)
class Worker:
    """One worker of a model and the calls it has in flight through us."""

    client: EngineClient
    outstanding: int = 0

    def release(self) -> None:
        """Called once when one of its calls ends, however it ends."""
        self.outstanding -= 1


@dataclass(eq=False)
class ModelPool:
    """A model as the gateway serves it."""

    name: str
    kind: str
    workers: list[Worker] = field(default_factory=list)
    max_context: int | None = None
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self, exclude: set[Worker]) -> Worker | None:
        """The least loaded worker not yet tried; ties rotate."""
        candidates = [w for w in self.workers if w not in exclude]
        if not candidates:
            return None
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda w: w.outstanding)


class Fleet:
    """Every model of the config; create it on the loop that will serve requests."""

    def __init__(self, models: list[ModelConfig]) -> None:
        self.models: dict[str, ModelPool] = {}
        for model in models:
            pool = ModelPool(model.name, model.kind, max_context=model.max_model_len)
            pool.workers = [Worker(EngineClient(address)) for address in model.workers]
            self.models[model.name] = pool
        llms = [m.name for m in models if m.kind == "llm"]
        self.default_model = llms[0] if llms else None

    def get(self, name: str | None) -> ModelPool:
        """The LLM pool a request names (the first LLM when it names none)."""
        pool = self.models.get(name if name is not None else self.default_model or "")
        if pool is None:
            raise errors.ModelNotFound(f"The model `{name}` does not exist.", param="model")
        if pool.kind != "llm":
            raise errors.NotAnLLM(
                f"The model `{name}` is not a language model and is not served by this route.",
                param="model",
            )
        return pool

    async def describe_all(self) -> None:
        """Learns each LLM's context length from its workers; a silent worker is
        logged and skipped, since it may come up later."""

        async def describe(pool: ModelPool, worker: Worker) -> None:
            try:
                models = await worker.client.describe(DESCRIBE_TIMEOUT)
            except errors.EngineError as error:
                log.warning("worker %s did not describe itself: %s", worker.client.address, error)
                return
            for model in models:
                if model.name == pool.name and pool.max_context is None:
                    pool.max_context = model.max_context

        await asyncio.gather(
            *(
                describe(pool, worker)
                for pool in self.models.values()
                if pool.kind == "llm"
                for worker in pool.workers
            )
        )

    async def start(
        self,
        pool: ModelPool,
        request: GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> tuple[Started, EngineStream]:
        """Starts the request on a worker and waits for its `Started`, retrying
        retryable refusals on other workers; returns that event and the stream."""
        tried: set[Worker] = set()
        last_error: errors.EngineError | None = None
        while (worker := pool.pick(tried)) is not None:
            tried.add(worker)
            worker.outstanding += 1
            stream = worker.client.generate(
                request, deadline.remaining(), metadata, on_close=worker.release
            )
            try:
                first = await anext(stream, None)
            except errors.EngineError as error:
                if not error.retryable:
                    raise
                log.info("retrying on another worker after %s", type(error).__name__)
                last_error = error
                continue
            except BaseException:
                stream.cancel()
                raise
            if not isinstance(first, Started):
                stream.cancel()
                raise errors.Failed("The engine worker did not start the answer properly.")
            return first, stream
        if last_error is not None:
            raise last_error
        raise errors.Unavailable(f"No worker is available for the model `{pool.name}`.")

    async def close(self) -> None:
        """Closes every worker's channel."""
        await asyncio.gather(
            *(w.client.close() for pool in self.models.values() for w in pool.workers)
        )
