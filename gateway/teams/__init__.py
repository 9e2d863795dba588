"""Teams: who calls (API keys) and how much they may (limits).

    Teams                          this module: the teams of one gateway
    ├── KeyRing          keys.py        Bearer key → team, by SHA-256, constant time
    ├── Limiter          limiter.py     requests/tokens per minute, concurrency → 429
    │   └── RedisStore   redis_store.py the same limits shared by every replica
    ├── Accounts         accounts.py    budgets and the usage ledger: reserve, settle
    │   ├── Budgets      budgets.py     spend over UTC days and months → 429 budget_exceeded
    │   └── Ledger       usage.py       usage per team x model x key id x day
    ├── SettingsReload   reload.py      budgets, prices, aliases, fallbacks: hot reload
    ├── Team, Bucket     team.py, bucket.py
    └── headers, metrics                x-ratelimit-* headers; /metrics families
    accounts.py      what teams spend: the reserve and settle admission calls
    budgets.py       budgets over UTC day and month windows, local or in Redis
    usage.py         the usage ledger per team, model, key and day
    reload.py        the config file read again: budgets, prices, aliases, fallbacks

A request of a keyed gateway goes: key (401, in `gateway.edge.middleware`), then
the admission's stages (`gateway.admission.admit`): model allowed for its team
(404, as for a model that does not exist) → the team's limits (429) → a slot by
the teams' fair share or the model's queue (503). With no keys configured the
gateway is open: no teams, no limits, and plain slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from gateway.config import Config
from gateway.fleet.aliases import Aliases
from gateway.teams.accounts import Accounts, AccountsCollector
from gateway.teams.headers import rate_limit_headers
from gateway.teams.keys import KeyRing
from gateway.teams.limiter import Limiter
from gateway.teams.metrics import TeamsCollector
from gateway.teams.reload import SettingsReload
from gateway.teams.team import Team

__all__ = ["Team", "Teams", "rate_limit_headers"]

log = logging.getLogger("furnace.teams")

#: The ASGI scope key under which the edge leaves the caller's team.
SCOPE_KEY = "furnace.team"
#: Seconds between looks at `keys_file` (and the config file, for `SettingsReload`).
KEYS_RELOAD_INTERVAL = 10.0


def team_of(scope: Mapping[str, Any]) -> Team | None:
    """The team the request's key names, or None on an open gateway."""
    return scope.get(SCOPE_KEY)


def _limited(config: Config) -> list[str]:
    """The teams with a limit or a budget."""
    limits = ("max_concurrent_requests", "requests_per_minute", "tokens_per_minute")
    return [
        team.name
        for team in config.teams
        if team.budgets or any(getattr(team, name) is not None for name in limits)
    ]


class Teams:
    """The teams of one gateway; start and close it on the serving loop. With
    `config_file` (the file `config` was read from), what `SettingsReload` may change
    is read again from it when it changes, as `keys_file` is."""

    def __init__(
        self,
        config: Config,
        registry: CollectorRegistry,
        config_file: str | None = None,
        share: Callable[[Config], Config] | None = None,
    ) -> None:
        self.by_name = {t.name: Team(t) for t in config.teams}
        self.keyed = bool(config.keys) or config.keys_file is not None
        self.keys = KeyRing(config, self.by_name)
        self.limiter = Limiter(config, self.by_name.values())
        #: Budgets and the usage ledger, in the limits' Redis (if any).
        self.accounts = Accounts(config, self.by_name.values(), self.limiter.redis)
        #: The aliases and fallbacks admission draws from (reloaded in place).
        self.aliases = Aliases(config)
        self.settings: SettingsReload | None = None
        if config_file is not None:
            self.settings = SettingsReload(
                config_file,
                (m.name for m in config.models),
                self.by_name,
                self.accounts.budgets,
                self.aliases,
                share,
            )
        self.auth_failures = 0
        self._reload: asyncio.Task[None] | None = None
        self._has_keys_file = config.keys_file is not None
        #: Teams with limits or budgets that live in this process alone (no Redis).
        self._local = [] if config.redis_url is not None else _limited(config)
        registry.register(TeamsCollector(self))
        registry.register(AccountsCollector(self.accounts))

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
        if self._local:
            log.warning(
                "teams' limits and budgets (%s) are kept in this process's memory: every "
                "replica enforces each in full (two replicas let a team through twice), and "
                "a restart forgets what budgets have counted (set redis_url to share them)",
                ", ".join(self._local),
            )
        await self.limiter.start()
        await self.accounts.start()
        if self._has_keys_file or self.settings is not None:
            self._reload = asyncio.get_running_loop().create_task(self._reload_keys())

    async def close(self) -> None:
        """Stops the background work and closes Redis."""
        if self._reload is not None:
            self._reload.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reload
        await self.accounts.close()
        await self.limiter.close()

    async def _reload_keys(self) -> None:
        while True:
            await asyncio.sleep(KEYS_RELOAD_INTERVAL)
            try:
                self.keys.reload_if_changed()
                if self.settings is not None:
                    self.settings.reload_if_changed()
            except Exception:  # the look must outlive any surprise, or keys stop rotating
                log.exception("reading the keys file or the config file again failed")

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
