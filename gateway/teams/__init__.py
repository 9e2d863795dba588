"""Teams: who calls (API keys), how much they may (limits), and their share of
the gateway's slots when slots are scarce.

    Teams                          this module: the edge's one entry point
    ├── KeyRing          keys.py        Bearer key → team, by SHA-256, constant time
    ├── Limiter          limiter.py     requests/tokens per minute, concurrency → 429
    │   └── RedisStore   redis_store.py the same limits shared by every replica
    ├── FairShare        fair_share.py  weighted shares of the slots → 503
    ├── Team, Bucket     team.py, bucket.py
    └── headers, metrics                x-ratelimit-* headers; /metrics families
    accounts.py      what teams spend: the reserve and settle admission calls
    budgets.py       budgets over UTC day and month windows, local or in Redis
    usage.py         the usage ledger per team, model, key and day

A request of a keyed gateway goes: key (401, in `gateway.edge.middleware`) →
model allowed for its team (404, as for a model that does not exist) → the
team's limits (429) → a slot by fair share (503). With no keys configured the
gateway is open: no teams, no limits, and plain slots. A model with a `queue`
takes its slot through the queue instead (gateway.admission.queue): by
priority (the team's, or lower by `x-furnace-priority`), then by the teams'
weights, within `max_wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.admission.metrics import QueueCollector
from gateway.admission.queue import Queue, QueueSettings
from gateway.admission.slots import Slots
from gateway.config import Config
from gateway.protocol import errors
from gateway.protocol.types import EmbedRequest, GenerateRequest
from gateway.teams.fair_share import FairShare
from gateway.teams.headers import rate_limit_headers
from gateway.teams.keys import KeyRing
from gateway.teams.limiter import Limiter
from gateway.teams.metrics import TeamsCollector
from gateway.teams.team import Team
from gateway.telemetry.record import RequestRecord

__all__ = ["Team", "Teams", "rate_limit_headers"]

log = logging.getLogger("furnace.teams")

#: The ASGI scope key under which the edge leaves the caller's team.
SCOPE_KEY = "furnace.team"
#: Seconds between looks at `keys_file`.
KEYS_RELOAD_INTERVAL = 10.0


def team_of(scope: Mapping[str, Any]) -> Team | None:
    """The team the request's key names, or None on an open gateway."""
    return scope.get(SCOPE_KEY)


class Teams:
    """The teams of one gateway; start and close it on the serving loop."""

    def __init__(self, config: Config, slots: Slots, registry: CollectorRegistry) -> None:
        self.slots = slots
        self.by_name = {t.name: Team(t) for t in config.teams}
        self.keyed = bool(config.keys) or config.keys_file is not None
        self.keys = KeyRing(config, self.by_name)
        demand_memory = max(5.0, 3.0 * config.retry_after)
        self.fair_share = FairShare(slots, self.by_name.values(), demand_memory)
        self.limiter = Limiter(config, self.by_name.values())
        self.auth_failures = 0
        self._reload: asyncio.Task[None] | None = None
        self._has_keys_file = config.keys_file is not None
        registry.register(TeamsCollector(self))
        #: Each queued model's settings; no entry: refused at once when full.
        self.queues = {
            m.name: QueueSettings(m.queue.max_wait, m.queue.max_depth, m.queue.max_starvation)
            for m in config.models
            if m.queue is not None
        }
        self.queue = Queue(slots) if self.queues else None
        if self.queue is not None:
            registry.register(QueueCollector(self.queue))

    async def start(self) -> None:
        """Says whether the gateway is open; starts the limits (and Redis)."""
        if not self.keyed:
            log.warning(
                "no API keys configured (keys, keys_file): the gateway is open to anyone "
                "who can reach it, with no team limits"
            )
        else:
            log.info(
                "API keys required on /v1/*: %d keys, %d teams",
                self.keys.count,
                len(self.by_name),
            )
        await self.limiter.start()
        if self._has_keys_file:
            self._reload = asyncio.get_running_loop().create_task(self._reload_keys())

    async def close(self) -> None:
        """Stops the background work and closes Redis."""
        if self._reload is not None:
            self._reload.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reload
        await self.limiter.close()

    async def _reload_keys(self) -> None:
        while True:
            await asyncio.sleep(KEYS_RELOAD_INTERVAL)
            self.keys.reload_if_changed()

    def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Team | None:
        """The caller's team, or None (counted) when its key is missing or unknown."""
        team = self.keys.team_of(headers)
        if team is None:
            self.auth_failures += 1
        return team

    @staticmethod
    def sees(team: Team | None, model: str) -> bool:
        """Whether the caller may use and list `model`."""
        return team is None or team.sees(model)

    @asynccontextmanager
    async def admit(
        self,
        team: Team | None,
        model: str,
        request: GenerateRequest | EmbedRequest,
        record: RequestRecord,
        priority: int | None = None,
        gone: asyncio.Future[None] | None = None,
    ) -> AsyncIterator[None]:
        """Holds what a request needs for the body of an `async with`: its team's
        limits and a slot (waiting in the model's queue, if it has one, until
        `gone` is done). Raises ModelNotFound, RateLimited or Busy."""
        settings = self.queues.get(model)
        if settings is not None and self.queue is not None:
            async with self._queued(team, model, request, record, settings, priority, gone):
                yield
            return
        if team is None:
            with self.slots.hold():
                yield
            return
        if not team.sees(model):
            raise errors.ModelNotFound(f"The model `{model}` does not exist.", param="model")
        lease = await self.limiter.admit(team, request, record)
        try:
            with self.fair_share.hold(team):
                lease.served = True
                yield
        finally:
            await self.limiter.release(lease)

    @asynccontextmanager
    async def _queued(
        self,
        team: Team | None,
        model: str,
        request: GenerateRequest | EmbedRequest,
        record: RequestRecord,
        settings: QueueSettings,
        priority: int | None,
        gone: asyncio.Future[None] | None,
    ) -> AsyncIterator[None]:
        """A slot through the queue: the team's priority (a request may ask for a
        lower one) and weight order the wait; the fair share's door rule is the
        queue's order instead."""
        assert self.queue is not None
        if team is None:
            async with self.queue.hold(model, settings, priority or 0, gone=gone):
                yield
            return
        if not team.sees(model):
            raise errors.ModelNotFound(f"The model `{model}` does not exist.", param="model")
        own = team.config.priority
        asked = own if priority is None else min(priority, own)
        lease = await self.limiter.admit(team, request, record)
        try:
            async with self.queue.hold(model, settings, asked, team.name, team.weight, gone):
                team.slots += 1
                lease.served = True
                try:
                    yield
                finally:
                    team.slots -= 1
        finally:
            await self.limiter.release(lease)
