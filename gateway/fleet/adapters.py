"""LoRA adapters: a model that is an adapter of another (`adapter_of`) is served by
that base model's workers under its own name, as vLLM serves an adapter (its
requests name the adapter as their `model`).

An adapter is a pool of its own for everything keyed by a model's name (teams'
models, aliases, fallbacks, queues, budgets and prices, metrics, `/v1/models`),
whose workers are its base's: the same `Worker` objects, found, health-checked and
counted by the base (`AdapterPool.workers` is the base's dict), so a worker's calls
in flight count every model it serves at once.

Which worker: among the base's available workers, those that hold the adapter (their
`/v1/models` lists it, read again every health interval, or this gateway loaded it
there) while one of them has room, as the Gateway API inference extension's LoRA
affinity does: a worker that already holds an adapter serves it without a load, and
the adapters spread no further than the load needs. Else any available worker, and
the adapter is loaded there first (`adapter_path`, vLLM's `/v1/load_lora_adapter`):
once per worker, every request for it waiting on the same load, which a client
leaving does not cancel. Without `adapter_path` the workers serve the adapter from
their start (`--lora-modules`): only those listing it are picked.

A worker that restarted has forgotten what was loaded: its answer is a 404 for the
adapter's name before the first event, which takes the worker off the holders and is
tried again (as any 404 before the first event is), that worker included: the adapter
is loaded there again. Its `/v1/models`, read every health interval, says the same
sooner.

What it costs: nothing for a base model's requests; an adapter's pick walks the
base's available workers once (the holders).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import replace

from gateway.config import Config, ModelConfig
from gateway.fleet.pool import ModelPool
from gateway.fleet.worker import Worker
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import GenerateRequest
from gateway.upstreams.base import LoadsAdapters

log = logging.getLogger("furnace.fleet")

#: The longest a load of an adapter on a worker may take (a large adapter fetched
#: from a hub takes a while); each request waits on it no longer than its deadline.
LOAD_TIMEOUT = 300.0


class AdapterPool(ModelPool):
    """A LoRA adapter of `base`: its workers, loaded with the adapter where needed."""

    def __init__(self, model: ModelConfig, config: Config, base: ModelPool) -> None:
        super().__init__(replace(model, workers=()), config, base.make_upstream)
        self.base = base
        self.path = model.adapter_path
        self.workers = base.workers  # the same dict: joins and leaves are the base's
        #: Loads under way, by worker: every request for the adapter there waits on it.
        self._loads: dict[Worker, asyncio.Task[None]] = {}
        #: Loads by outcome (`loaded`, `failed`), for metrics.
        self.loads_total: Counter[str] = Counter()

    @property
    def max_context(self) -> int | None:
        """The base's context (the base's workers say it)."""
        return self.base.max_context if self.base is not None else None

    @max_context.setter
    def max_context(self, value: int | None) -> None:
        pass  # set by ModelPool's constructor; the base's is the one

    def holds(self, worker: Worker) -> bool:
        """Whether `worker` serves the adapter now (it lists it, or it was loaded there)."""
        return self.name in worker.adapters

    def available(self, exclude: set[Worker]) -> list[Worker]:
        return self._base.available(exclude)

    def saturated(self) -> bool:
        return self._base.saturated()

    def features(self) -> frozenset[str] | None:
        return self._base.features()

    def _candidates(self, exclude: set[Worker]) -> list[Worker]:
        """The workers to pick among: the holders while one has room, else (with a path
        to load from) every available worker."""
        base = self._base
        available = base.available(exclude)
        holders = [w for w in available if self.holds(w)]
        if self.path is None:
            return holders
        now = time.monotonic()
        return holders if any(base.has_room(w, now) for w in holders) else available

    def pick(self, request: GenerateRequest, exclude: set[Worker]) -> Worker | None:
        candidates = self._candidates(exclude)
        return self.balancer.pick(candidates, request) if candidates else None

    def pick_for_unary(self, exclude: set[Worker]) -> Worker | None:
        candidates = self._candidates(exclude)
        return self._unary.pick_any(candidates) if candidates else None

    def no_worker(self) -> errors.Unavailable:
        if self.path is None:
            return errors.Unavailable(
                f"No healthy worker of `{self._base.name}` serves the adapter `{self.name}`."
            )
        return super().no_worker()

    async def ready(self, worker: Worker, deadline: Deadline) -> None:
        """Loads the adapter on `worker` unless it holds it (one load a worker, shared),
        waiting no longer than `deadline`."""
        if self.holds(worker) or self.path is None:
            return
        load = self._loads.get(worker)
        if load is None:
            load = asyncio.get_running_loop().create_task(self._load(worker, self.path))
            self._loads[worker] = load
            load.add_done_callback(lambda done: self._loaded(worker, done))
        try:
            async with asyncio.timeout(deadline.remaining()):
                await asyncio.shield(load)
        except TimeoutError:
            raise errors.Timeout(
                f"The adapter `{self.name}` was not loaded on a worker in time."
            ) from None

    async def _load(self, worker: Worker, path: str) -> None:
        upstream = worker.upstream
        if not isinstance(upstream, LoadsAdapters):  # the config allows no other
            raise errors.Failed(f"The worker {worker.address} cannot load adapters.")
        log.info("adapter %s: loading on %s from %s", self.name, worker.address, path)
        await upstream.load_adapter(self.name, path, LOAD_TIMEOUT)

    def _loaded(self, worker: Worker, load: asyncio.Task[None]) -> None:
        """A load ended: the worker holds the adapter, or the failure is logged (and
        retrieved: no waiter may be left to read it)."""
        self._loads.pop(worker, None)
        if load.cancelled():
            return
        failure = load.exception()
        if failure is None:
            worker.adapters = worker.adapters | {self.name}
            self.loads_total["loaded"] += 1
            return
        self.loads_total["failed"] += 1
        log.warning("adapter %s: not loaded on %s: %s", self.name, worker.address, failure)

    def forget(self, worker: Worker) -> bool:
        """`worker` answered that it does not know the adapter (it restarted): it holds
        it no more. Whether it may be tried again (a load there may bring it back)."""
        if self.holds(worker):
            log.info("adapter %s: %s no longer serves it", self.name, worker.address)
            worker.adapters = worker.adapters - {self.name}
            return self.path is not None
        return False

    async def cancel_loads(self) -> None:
        """Stops the loads under way (the fleet is closing)."""
        loads = list(self._loads.values())
        for load in loads:
            load.cancel()
        await asyncio.gather(*loads, return_exceptions=True)

    @property
    def _base(self) -> ModelPool:
        assert self.base is not None
        return self.base
