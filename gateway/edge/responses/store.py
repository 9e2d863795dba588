"""Stored responses (`store: true`, OpenAI's default): what `GET /v1/responses/{id}`,
its `input_items` and `previous_response_id` read back, per team.

A stored response is one JSON value: the response object, this turn's input items,
the conversation before them (`history`: the earlier turns' input and output items,
so a continuation is one read, not a walk of the chain), the turn's depth, the worker
that served it and the conversation's session key (for affinity). Its cost: a turn
stores the whole conversation again, which the depth bound (`responses_max_depth`)
and the input bound (`max_messages`) keep finite.

Two stores behind one interface:
- `RedisResponses`, when `redis_url` is set: shared by every replica, on the teams'
  Redis client (`gateway.teams.redis_store`: same timeout, no retries). Keys
  (`P` is `redis_key_prefix`; `{team}` a hash tag, one slot per team):

      P:responses:{team}:ID      the stored JSON, expiring after `responses_ttl`
      P:responses:{team}:index   sorted set of the team's ids by time stored
      P:responses:{team}:ID:events  a streamed background response's events
                                 (shared_events.py: written and read there)

  One Lua script stores a response and trims the index to `responses_per_team`
  (the oldest dropped, with their values) and to the TTL.
- `MemoryResponses` otherwise: this process's memory, the same bounds and at most
  `MEMORY_BYTES_PER_TEAM` bytes a team, oldest dropped first; replicas (and a
  gateway's several processes) do not share it, which the gateway warns about at start.

A team reads only its own responses: another team's id is not found (404), as an id
that never was. An open gateway's requests are one team, "".

Background responses (background.py) change state while they run, and a cancel may
come at any replica, so a state change is a compare-and-set (`put_if`: written only
from the states named; one Lua script on Redis), and a cancel made at one replica is a
flag (`P:responses:{team}:ID:cancel`, expiring) that the replica running it polls
(`cancels_asked`). An unfinished one carries its `deadline` (wall clock): one still
unfinished past it lost its replica (killed without a drain), and is read as `failed`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from gateway.protocol import errors

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.commands.core import AsyncScript

    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.responses")

#: The most bytes of stored responses a team holds in a gateway's memory (the oldest
#: dropped past it): a conversation is stored again at every turn, so the count alone
#: would let 10,000 deep conversations take gigabytes. (Redis is bounded by its own
#: `maxmemory`, as its operator sets it.)
MEMORY_BYTES_PER_TEAM = 256 * 1024 * 1024
#: A background response's states before its end.
UNFINISHED = ("queued", "in_progress")

S = TypeVar("S", bound=Sized)
#: A registered script with its keys and arguments (`RedisResponses.put`'s `also`).
Also = tuple["AsyncScript", list[str], list[Any]]


def drop_oldest(kept: OrderedDict[str, tuple[float, S]], size: int, per_team: int) -> int:
    """A team's memory kept in bounds: its oldest values (`(expires, value)`, the
    value's `len` its bytes) dropped while it holds more than `per_team` of them or
    more than `MEMORY_BYTES_PER_TEAM` bytes, or the oldest has expired; the bytes left."""
    now = time.monotonic()
    while kept and (
        len(kept) > per_team or size > MEMORY_BYTES_PER_TEAM or next(iter(kept.values()))[0] <= now
    ):
        size -= len(kept.popitem(last=False)[1][1])
    return size


@dataclass(slots=True)
class Stored:
    """One stored response (see the module docstring)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    depth: int = 1
    worker: str = ""
    session: str = ""
    #: An unfinished background response's latest possible end (seconds since the
    #: epoch; 0: none): past it, it is read as failed (`seen`).
    deadline: float = 0.0

    def dumps(self) -> bytes:
        return orjson.dumps(
            {
                "response": self.response,
                "input": self.input,
                "history": self.history,
                "depth": self.depth,
                "worker": self.worker,
                "session": self.session,
                "deadline": self.deadline,
            }
        )

    @classmethod
    def loads(cls, raw: bytes | str) -> Stored:
        value = orjson.loads(raw)
        return cls(
            value["response"],
            value["input"],
            value["history"],
            value["depth"],
            value["worker"],
            value["session"],
            value.get("deadline", 0.0),
        )

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def status(self) -> str:
        return str(self.response["status"])

    def seen(self, now: float | None = None) -> Stored:
        """As a reader sees it: an unfinished background response past its deadline
        lost the replica that ran it (killed without a drain), and is `failed`."""
        if not self.deadline or self.status not in UNFINISHED:
            return self
        if (time.time() if now is None else now) <= self.deadline:
            return self
        error = {
            "code": "server_error",
            "message": "The gateway replica that ran this background response stopped "
            "before it ended; create it again.",
        }
        lost = {**self.response, "status": "failed", "error": error}
        return Stored(lost, self.input, self.history, self.depth, self.worker, self.session)

    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation of this response follows: all before it, its input,
        its output."""
        return [*self.history, *self.input, *self.response["output"]]


class ResponseStore:
    """Where responses are kept, per team; bounded in count per team and in time."""

    def __init__(self, ttl: float, per_team: int) -> None:
        self.ttl = ttl
        self.per_team = per_team

    async def put(self, team: str, stored: Stored) -> None:
        """Keeps `stored` (the oldest of the team dropped past the bound)."""
        raise NotImplementedError

    async def get(self, team: str, response_id: str) -> Stored | None:
        """The team's stored response, or None (never stored, expired, dropped, deleted,
        or another team's)."""
        raise NotImplementedError

    async def delete(self, team: str, response_id: str) -> bool:
        """Whether the team had it (it is gone now)."""
        raise NotImplementedError

    async def put_if(self, team: str, stored: Stored, states: tuple[str, ...]) -> str | None:
        """Keeps `stored` in place of the team's response of the same id, only if that
        one's status is one of `states`, in one step; returns that status (None: none
        stored, and nothing written)."""
        raise NotImplementedError

    async def ask_cancel(self, team: str, response_id: str, ttl: float) -> None:
        """Tells the replica running the response that it is cancelled (for `ttl` s)."""

    async def cancels_asked(self, runs: list[tuple[str, str]]) -> set[str]:
        """Of the (team, id) pairs, the ids whose cancel `ask_cancel` asked."""
        return set()


class MemoryResponses(ResponseStore):
    """This process's store: per team, the newest `per_team` within the TTL."""

    def __init__(self, ttl: float, per_team: int) -> None:
        super().__init__(ttl, per_team)
        self._teams: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}

    async def put(self, team: str, stored: Stored) -> None:
        kept = self._teams.setdefault(team, OrderedDict())
        raw = stored.dumps()
        old = kept.pop(stored.id, None)
        size = self._bytes.get(team, 0) + len(raw) - (0 if old is None else len(old[1]))
        kept[stored.id] = (time.monotonic() + self.ttl, raw)
        self._bytes[team] = drop_oldest(kept, size, self.per_team)

    async def get(self, team: str, response_id: str) -> Stored | None:
        kept = self._teams.get(team)
        found = None if kept is None else kept.get(response_id)
        if found is None or found[0] <= time.monotonic():
            return None
        return Stored.loads(found[1]).seen()

    async def delete(self, team: str, response_id: str) -> bool:
        kept = self._teams.get(team)
        found = None if kept is None else kept.pop(response_id, None)
        if found is None:
            return False
        self._bytes[team] -= len(found[1])
        return True

    async def put_if(self, team: str, stored: Stored, states: tuple[str, ...]) -> str | None:
        # one process, no await between the read and the write: one step
        # (a cancel here always reaches the run itself: no flag to ask)
        kept = self._teams.get(team)
        found = None if kept is None else kept.get(stored.id)
        if found is None or found[0] <= time.monotonic():
            return None
        status = Stored.loads(found[1]).status
        if status in states:
            await self.put(team, stored)
        return status


def trim_index(index: str, dropped: str) -> str:
    """The Lua that adds the id ARGV[5] at now ARGV[3] (ms) to the team's index `index`
    (a KEYS entry), then drops from it the ids older than the TTL ARGV[2] (ms) and the
    oldest past the bound ARGV[4], deleting for each id the keys `dropped` names (Lua,
    `id` and the prefix ARGV[6] in scope), and returns how many it dropped: a stored
    response's and a conversation's bookkeeping, one script each with its own write."""
    return f"""
redis.call('ZADD', {index}, ARGV[3], ARGV[5])
local gone = redis.call('ZRANGEBYSCORE', {index}, '-inf', tonumber(ARGV[3]) - tonumber(ARGV[2]))
local extra = redis.call('ZCARD', {index}) - #gone - tonumber(ARGV[4])
if extra > 0 then
  local oldest = redis.call('ZRANGE', {index}, #gone, #gone + extra - 1)
  for _, id in ipairs(oldest) do table.insert(gone, id) end
end
for _, id in ipairs(gone) do
  redis.call('ZREM', {index}, id)
  redis.call('DEL', {dropped})
end
redis.call('PEXPIRE', {index}, ARGV[2])
return #gone
"""


_PUT = "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])" + trim_index("KEYS[2]", "ARGV[6] .. id")


#: `put_if`: KEYS[1] the response; ARGV[1] the new value, ARGV[2..] the states it may
#: replace. The stored status is read without decoding the whole value (a conversation
#: may be megabytes): the response object is the value's first key, and its `status`
#: comes before its `output`, as `Stored.dumps` and the encoder write them.
_PUT_IF = """
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
local status = string.match(raw, '^{"response":{.-"status":"([a-z_]+)"')
if not status then return false end
for i = 2, #ARGV do
  if ARGV[i] == status then
    local ttl = redis.call('PTTL', KEYS[1])
    if ttl > 0 then
      redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
    else
      redis.call('SET', KEYS[1], ARGV[1])
    end
    return status
  end
end
return status
"""


async def run_scripts(client: Redis, calls: list[Also]) -> list[Any]:
    """Registered scripts run in one pipeline, one round trip (a pipeline given the
    scripts themselves asks SCRIPT EXISTS first: a second); the first error raised.
    A script Redis lost (a restart) is loaded and the pipeline run again."""
    from redis.exceptions import NoScriptError  # redis only with `redis_url`

    for attempt in (0, 1):
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        replies = await pipe.execute(raise_on_error=False)
        lost = [
            s for (s, _, _), r in zip(calls, replies, strict=True) if isinstance(r, NoScriptError)
        ]
        if not lost or attempt:
            break
        for script in {id(s): s for s in lost}.values():
            script.sha = await client.script_load(script.script)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return list(replies)


class RedisResponses(ResponseStore):
    """The store every replica shares, on the teams' Redis client; a failure is
    `Unavailable` (503) for the request that needed it."""

    def __init__(self, redis: RedisStore, ttl: float, per_team: int) -> None:
        super().__init__(ttl, per_team)
        self.redis = redis
        self._put = redis.script(_PUT)
        self._put_if = redis.script(_PUT_IF)

    def _prefix(self, team: str) -> str:
        return f"{self.redis.prefix}:responses:{{{team}}}:"

    async def put(self, team: str, stored: Stored, also: Also | None = None) -> None:
        """`also`: a script of another module's, run in the same round trip (after the
        put: a streamed background response's first event, shared_events.py)."""
        prefix = self._prefix(team)
        ttl_ms = max(1, int(self.ttl * 1000))
        now_ms = int(time.time() * 1000)
        keys = [prefix + stored.id, prefix + "index"]
        args: list[Any] = [stored.dumps(), ttl_ms, now_ms, self.per_team, stored.id, prefix]
        try:
            async with self.redis._bounded():
                if also is None:
                    await self._put(keys=keys, args=args)
                else:
                    await run_scripts(self.redis.client, [(self._put, keys, args), also])
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None

    async def get(self, team: str, response_id: str) -> Stored | None:
        try:
            async with self.redis._bounded():
                raw = await self.redis.client.get(self._prefix(team) + response_id)
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None
        return None if raw is None else Stored.loads(raw).seen()

    async def delete(self, team: str, response_id: str) -> bool:
        prefix = self._prefix(team)
        try:
            async with self.redis._bounded():
                removed = await self.redis.client.delete(prefix + response_id)
                await self.redis.client.zrem(prefix + "index", response_id)
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None
        return bool(removed)

    async def put_if(self, team: str, stored: Stored, states: tuple[str, ...]) -> str | None:
        try:
            async with self.redis._bounded():
                status = await self._put_if(
                    keys=[self._prefix(team) + stored.id], args=[stored.dumps(), *states]
                )
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None
        if status is None:
            return None
        return status.decode() if isinstance(status, bytes) else str(status)

    async def ask_cancel(self, team: str, response_id: str, ttl: float) -> None:
        key = self._prefix(team) + response_id + ":cancel"
        try:
            async with self.redis._bounded():
                await self.redis.client.set(key, b"1", px=max(1, int(ttl * 1000)))
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None

    async def cancels_asked(self, runs: list[tuple[str, str]]) -> set[str]:
        if not runs:
            return set()
        try:
            async with self.redis._bounded():
                pipe = self.redis.client.pipeline(transaction=False)
                for team, response_id in runs:
                    pipe.exists(self._prefix(team) + response_id + ":cancel")
                found = await pipe.execute()
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The response store failed: {error}") from None
        return {response_id for (_, response_id), hit in zip(runs, found, strict=True) if hit}


def open_store(redis: RedisStore | None, ttl: float, per_team: int) -> ResponseStore:
    """The store for this gateway: Redis when it has one, else its memory (with a
    warning: replicas and processes do not share it)."""
    if redis is not None:
        return RedisResponses(redis, ttl, per_team)
    log.warning(
        "stored responses and conversations (/v1/responses, /v1/conversations) are kept "
        "in this process's memory, at most %d responses per team for %.0f s: replicas "
        "and processes do not share them "
        "(set redis_url to share them)",
        per_team,
        ttl,
    )
    return MemoryResponses(ttl, per_team)
