"""Teams' limits in Redis, so every gateway replica enforces one limit together.

Schema (`P` is `redis_key_prefix`; `{team}` is a hash tag, so one team's keys
share a Redis Cluster slot and one script may touch them all):

    P:limits:{team}:requests   hash {u: usage, t: ms}   requests-per-minute bucket
    P:limits:{team}:tokens     hash {u: usage, t: ms}   tokens-per-minute bucket
    P:limits:{team}:inflight   sorted set               concurrent requests:
                               member gateway:request, score = lease expiry (ms)

Buckets are the leaky buckets of `bucket.py`: usage drains at limit/60000 per
ms of Redis's own clock (TIME), so the replicas' clocks never matter. Admission
is one Lua script (atomic): drain, check requests, tokens (the prompt's
estimate and the completion reserved: `max_tokens`, or with none all that is
left of the minute) and concurrency, and only if all fit, charge them and add
the lease. Tokens charged later (as the answer streams) and refunds are one
script each. Keys expire once drained. A lease is renewed by its gateway while
the request lasts, so a gateway that dies stops holding its team's concurrency
once its leases expire (`redis_lease_ttl`, 10 s).

Every call has a short timeout and no retries: the limiter falls back to local
limits instead of waiting. Failures leave as `StoreDown` (an OSError) or
`TimeoutError`. The limiter imports this module only when `redis_url` is set
(the redis package pulls in OpenTelemetry when it finds it installed).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.teams.team import Team

#: Seconds a concurrency lease lives without renewal, unless the store is given
#: another (`redis_lease_ttl`); its gateway renews it every third of that.
LEASE_TTL = 10.0

_DRAIN = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) * 1000 + math.floor(tonumber(now_t[2]) / 1000)
local function level(key, limit)
  if limit <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'u', 't')
  local u = (tonumber(v[1]) or 0) - (now - (tonumber(v[2]) or now)) * limit / 60000
  if u < 0 then return 0 end
  return u
end
local function keep(key, limit, u)
  if limit <= 0 then return end
  redis.call('HSET', key, 'u', tostring(u), 't', now)
  redis.call('PEXPIRE', key, math.ceil(u * 60000 / limit) + 1000)
end
"""

# KEYS: requests, tokens, inflight; ARGV: rpm, tpm, prompt tokens, max concurrent,
# lease member, lease ms, completion tokens to reserve (-1: all that is left) (0 for
# a limit: none). Returns {refused limit or '', u_req, u_tok, completion reserved}.
_ADMIT = (
    _DRAIN
    + """
local rpm, tpm, cost, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
local reserve = tonumber(ARGV[7])
local ur, ut = level(KEYS[1], rpm), level(KEYS[2], tpm)
local refused = ''
if rpm > 0 and ur + 1 > rpm then
  refused = 'requests'
elseif tpm > 0 and ut + cost + math.max(reserve, 0) > tpm then
  refused = 'tokens'
else
  if conc > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
    if redis.call('ZCARD', KEYS[3]) >= conc then refused = 'concurrency' end
  end
  if refused == '' then
    if tpm <= 0 then
      reserve = 0
    elseif reserve < 0 then
      reserve = math.max(0, math.floor(tpm - ut - cost))
    end
    ur, ut = ur + 1, ut + cost + reserve
    keep(KEYS[1], rpm, ur)
    keep(KEYS[2], tpm, ut)
    if conc > 0 then
      redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
      redis.call('PEXPIRE', KEYS[3], ARGV[6])
    end
  end
end
return {refused, tostring(ur), tostring(ut), tostring(math.max(reserve, 0))}
"""
)

# KEYS: a bucket; ARGV: its limit, the amount (negative: a refund). Returns usage.
_CHARGE = (
    _DRAIN
    + """
local u = level(KEYS[1], tonumber(ARGV[1])) + tonumber(ARGV[2])
if u < 0 then u = 0 end
keep(KEYS[1], tonumber(ARGV[1]), u)
return tostring(u)
"""
)


class StoreDown(ConnectionError):
    """Redis failed to answer (refused, dropped, out of memory, ...)."""


class Admission:
    """What Redis answered: the limit that refused (or ''), usage after, and the
    completion tokens reserved."""

    __slots__ = ("refused", "requests_used", "reserved", "tokens_used")

    def __init__(self, reply: list[bytes]) -> None:
        self.refused = reply[0].decode()
        self.requests_used = float(reply[1])
        self.tokens_used = float(reply[2])
        self.reserved = int(reply[3])


class RedisStore:
    """The shared store; every method raises `StoreDown` or `TimeoutError` on failure."""

    def __init__(self, url: str, timeout: float, prefix: str, lease_ttl: float = LEASE_TTL) -> None:
        self.timeout = timeout
        self.prefix = prefix
        self.lease_ms = int(lease_ttl * 1000)
        self.client = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        #: Every module's scripts on this client, loaded by `ping`.
        self.scripts: list[AsyncScript] = []
        self._admit = self.script(_ADMIT)
        self._charge = self.script(_CHARGE)

    def script(self, text: str) -> AsyncScript:
        """A Lua script on this client, which `ping` keeps loaded in Redis."""
        script = self.client.register_script(text)
        self.scripts.append(script)
        return script

    @asynccontextmanager
    async def _bounded(self, extra: float = 0.0) -> AsyncIterator[None]:
        """One call: at most `timeout` seconds (and `extra` more, for a call that moves
        megabytes), and Redis's errors as `StoreDown`. A failure drops the idle
        connections too: after a restart of Redis they are all dead, and each would
        fail once more."""
        try:
            async with asyncio.timeout(self.timeout + extra):
                yield
        except RedisError as error:
            await self.client.connection_pool.disconnect(inuse_connections=False)
            raise StoreDown(f"{type(error).__name__}: {error}") from error
        except TimeoutError:
            await self.client.connection_pool.disconnect(inuse_connections=False)
            raise

    #: The same, for the budgets and the usage ledger, which share this client.
    bounded = _bounded

    def _key(self, team: Team, what: str) -> str:
        return f"{self.prefix}:limits:{{{team.name}}}:{what}"

    async def ping(self) -> None:
        """Raises unless Redis answers; loads the scripts it lacks (a Redis new or
        restarted), so that no request pays the round trips of loading one."""
        async with self._bounded():
            if not self.scripts:
                await self.client.ping()
                return
            held = await self.client.script_exists(*(s.sha for s in self.scripts))
            missing = [s for s, there in zip(self.scripts, held, strict=True) if not there]
            if missing:
                pipe = self.client.pipeline(transaction=False)
                for script in missing:
                    pipe.script_load(script.script)
                await pipe.execute()

    async def admit(self, team: Team, cost: int, reserve: int | None, member: str) -> Admission:
        """Checks and charges one request of `team` (atomically): its prompt's
        `cost` and `reserve` completion tokens (None: all that is left)."""
        config = team.config
        keys = [self._key(team, k) for k in ("requests", "tokens", "inflight")]
        args: list[int | str] = [
            config.requests_per_minute or 0,
            config.tokens_per_minute or 0,
            cost,
            config.max_concurrent_requests or 0,
            member,
            self.lease_ms,
            -1 if reserve is None else reserve,
        ]
        async with self._bounded():
            return Admission(await self._admit(keys=keys, args=args))

    async def charge(self, team: Team, what: str, limit: int, amount: float) -> float:
        """Adds `amount` to one bucket of `team`; returns its usage after."""
        async with self._bounded():
            reply = await self._charge(keys=[self._key(team, what)], args=[limit, amount])
        return float(reply)

    async def release(self, team: Team, member: str) -> None:
        """Ends a concurrency lease."""
        async with self._bounded():
            await self.client.zrem(self._key(team, "inflight"), member)

    async def release_many(self, leases: Iterable[tuple[Team, str]]) -> None:
        """Ends leases that may or may not be held, in one round trip."""
        async with self._bounded():
            pipe = self.client.pipeline(transaction=False)
            for team, member in leases:
                pipe.zrem(self._key(team, "inflight"), member)
            await pipe.execute()

    async def renew(self, leases: Iterable[tuple[Team, str]]) -> None:
        """Pushes back the expiry of the leases still held, in one round trip."""
        async with self._bounded():
            now_ms = int((await self.client.time())[0]) * 1000
            expiry = now_ms + self.lease_ms
            pipe = self.client.pipeline(transaction=False)
            for team, member in leases:
                key = self._key(team, "inflight")
                pipe.zadd(key, {member: expiry}, xx=True)
                pipe.pexpire(key, self.lease_ms)
            await pipe.execute()

    async def close(self) -> None:
        """Closes the connections."""
        await self.client.aclose()
