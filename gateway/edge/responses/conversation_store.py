"""Conversations (OpenAI's Conversations API, and the Responses API's `conversation`):
a conversation object and its items, per team, kept where the stored responses are.

A conversation is its object (`{id, object, created_at, metadata}`) and its items in
order (the Responses API's stored items: each with an id). Unlike a stored response,
a conversation is appended to, by several requests at once maybe (two turns of an
agent, a turn and an `items.create`), so the items are a list that an append extends
in one step, not a value written again whole.

Two stores behind one interface, as store.py's:
- `RedisConversations`, when `redis_url` is set: shared by every replica, on the teams'
  Redis client. Keys (`P` is `redis_key_prefix`; `{team}` a hash tag, one slot per team):

      P:conversations:{team}:ID         the conversation object's JSON
      P:conversations:{team}:ID:items   a list of the items' JSON, in order
      P:conversations:{team}:index      sorted set of the team's ids by last change

  Every change is one Lua script: an append checks the bound and RPUSHes in one step;
  a creation trims the index to `conversations_per_team` (the least recently changed
  dropped, with their keys) and to the TTL. Every change renews the TTL.
- `MemoryConversations` otherwise: this process's memory, the same bounds and at most
  `MEMORY_BYTES_PER_TEAM` bytes a team (store.py's), least recently changed dropped
  first; a change has no await between its read and its write, so it is one step.

Bounds: items per conversation (`conversations_max_items`: an append past it is
refused whole, `Full`), conversations per team, the TTL (`responses_ttl`, from the
last change), and bytes in memory. A team reads only its own conversations: another
team's id is not found (404), as an id that never was.

`conversation_history` is what a request that names a `conversation` reads: the
Responses API's turn, and the counting of its input tokens.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gateway.edge.errors import APIError
from gateway.edge.responses.params import Item, conversation_id
from gateway.edge.responses.store import drop_oldest, trim_index
from gateway.protocol import errors

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.responses")


class Full(Exception):
    """An append that would pass the conversation's bound on items."""

    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.held = held


def kept_item(item: Item) -> Item:
    """An item as a conversation shows it: a message with its `status` (the SDK's
    conversation `Message` has one), completed unless it says otherwise."""
    if item["type"] == "message" and "status" not in item:
        return {**item, "status": "completed"}
    return item


class ConversationStore:
    """Where conversations are kept, per team; bounded in count per team, in items per
    conversation and in time since their last change."""

    def __init__(self, ttl: float, per_team: int, max_items: int) -> None:
        self.ttl = ttl
        self.per_team = per_team
        self.max_items = max_items

    async def create(self, team: str, conversation: dict[str, Any], items: list[Item]) -> None:
        """Keeps a new conversation with its first items (the least recently changed of
        the team dropped past the bound)."""
        raise NotImplementedError

    async def get(self, team: str, conversation_id: str) -> dict[str, Any] | None:
        """The team's conversation object, or None (never made, expired, dropped,
        deleted, or another team's)."""
        raise NotImplementedError

    async def items(self, team: str, conversation_id: str) -> list[Item] | None:
        """The conversation's items in order, or None (no such conversation)."""
        raise NotImplementedError

    async def update(
        self, team: str, conversation_id: str, metadata: dict[str, str]
    ) -> dict[str, Any] | None:
        """The conversation with its metadata replaced, or None (no such conversation)."""
        raise NotImplementedError

    async def append(
        self, team: str, conversation_id: str, items: Sequence[Item], limit: int
    ) -> bool:
        """Adds the items at the end, in one step; False: no such conversation; `Full`
        where the conversation would then hold more than `limit` items."""
        raise NotImplementedError

    async def delete(self, team: str, conversation_id: str) -> bool:
        """Whether the team had it (it is gone now, with its items)."""
        raise NotImplementedError

    async def delete_item(self, team: str, conversation_id: str, item_id: str) -> bool | None:
        """Removes the item: True; False: the conversation has no such item; None: no
        such conversation."""
        raise NotImplementedError


@dataclass(slots=True)
class _Kept:
    """A conversation in memory: its object's and its items' JSON; its `len` is its bytes."""

    conversation: bytes
    items: list[bytes]
    size: int

    def __len__(self) -> int:
        return self.size


class MemoryConversations(ConversationStore):
    """This process's conversations: per team, the `per_team` changed last, within the
    TTL and `MEMORY_BYTES_PER_TEAM` bytes. No method awaits between its read and its
    write: each is one step for the requests of this process."""

    def __init__(self, ttl: float, per_team: int, max_items: int) -> None:
        super().__init__(ttl, per_team, max_items)
        self._teams: dict[str, OrderedDict[str, tuple[float, _Kept]]] = {}
        self._bytes: dict[str, int] = {}

    def _found(self, team: str, conversation_id: str) -> _Kept | None:
        conversations = self._teams.get(team)
        found = None if conversations is None else conversations.get(conversation_id)
        if found is None or found[0] <= time.monotonic():
            return None
        return found[1]

    def _changed(self, team: str, conversation_id: str, kept: _Kept, grown: int) -> None:
        """Kept as changed now (last in the order, its TTL renewed), `grown` bytes more."""
        conversations = self._teams.setdefault(team, OrderedDict())
        conversations.pop(conversation_id, None)
        conversations[conversation_id] = (time.monotonic() + self.ttl, kept)
        size = self._bytes.get(team, 0) + grown
        self._bytes[team] = drop_oldest(conversations, size, self.per_team)

    async def create(self, team: str, conversation: dict[str, Any], items: list[Item]) -> None:
        raws = [orjson.dumps(item) for item in items]
        raw = orjson.dumps(conversation)
        kept = _Kept(raw, raws, len(raw) + sum(map(len, raws)))
        self._changed(team, str(conversation["id"]), kept, kept.size)

    async def get(self, team: str, conversation_id: str) -> dict[str, Any] | None:
        kept = self._found(team, conversation_id)
        return None if kept is None else dict(orjson.loads(kept.conversation))

    async def items(self, team: str, conversation_id: str) -> list[Item] | None:
        kept = self._found(team, conversation_id)
        return None if kept is None else [orjson.loads(raw) for raw in kept.items]

    async def update(
        self, team: str, conversation_id: str, metadata: dict[str, str]
    ) -> dict[str, Any] | None:
        kept = self._found(team, conversation_id)
        if kept is None:
            return None
        conversation = {**orjson.loads(kept.conversation), "metadata": metadata}
        raw = orjson.dumps(conversation)
        grown = len(raw) - len(kept.conversation)
        kept.conversation, kept.size = raw, kept.size + grown
        self._changed(team, conversation_id, kept, grown)
        return conversation

    async def append(
        self, team: str, conversation_id: str, items: Sequence[Item], limit: int
    ) -> bool:
        kept = self._found(team, conversation_id)
        if kept is None:
            return False
        if len(kept.items) + len(items) > limit:
            raise Full(len(kept.items))
        raws = [orjson.dumps(item) for item in items]
        grown = sum(map(len, raws))
        kept.items.extend(raws)
        kept.size += grown
        self._changed(team, conversation_id, kept, grown)
        return True

    async def delete(self, team: str, conversation_id: str) -> bool:
        conversations = self._teams.get(team)
        found = None if conversations is None else conversations.pop(conversation_id, None)
        if found is None:
            return False
        self._bytes[team] -= found[1].size
        return found[0] > time.monotonic()

    async def delete_item(self, team: str, conversation_id: str, item_id: str) -> bool | None:
        kept = self._found(team, conversation_id)
        if kept is None:
            return None
        at = next((i for i, raw in enumerate(kept.items) if _id_of(raw) == item_id), None)
        if at is None:
            return False
        gone = len(kept.items.pop(at))
        kept.size -= gone
        self._changed(team, conversation_id, kept, -gone)
        return True


def _id_of(raw: bytes | str) -> str:
    return str(orjson.loads(raw)["id"])


#: A new conversation. KEYS: the object, its items, the index; ARGV: the object's
#: JSON, the TTL (ms), now (ms), the bound per team, the id, the keys' prefix, then the
#: items' JSON. The index is trimmed to the TTL and the bound, as store.py's `_PUT`.
_CREATE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[2])
if #ARGV > 6 then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, 7))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
""" + trim_index("KEYS[3]", "ARGV[6] .. id, ARGV[6] .. id .. ':items'")

#: A change of a conversation: its object replaced (ARGV[5], '' for none) and items
#: appended (ARGV[6..]) within the bound (ARGV[4]), its TTL (ARGV[1], ms) renewed and its
#: place in the index (ARGV[2] now, ARGV[3] the id) made the newest. KEYS as `_CREATE`'s.
#: Returns -1: no such conversation; -2 - n: full, holding n items; else the items held.
_CHANGE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local n = #ARGV - 5
local held = redis.call('LLEN', KEYS[2])
if n > 0 and held + n > tonumber(ARGV[4]) then return -2 - held end
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
if n > 0 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 6)) end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
return held + n
"""


class RedisConversations(ConversationStore):
    """The conversations every replica shares, on the teams' Redis client; a failure
    is `Unavailable` (503) for the request that needed it."""

    def __init__(self, redis: RedisStore, ttl: float, per_team: int, max_items: int) -> None:
        super().__init__(ttl, per_team, max_items)
        self.redis = redis
        self._create = redis.script(_CREATE)
        self._change = redis.script(_CHANGE)

    def _prefix(self, team: str) -> str:
        return f"{self.redis.prefix}:conversations:{{{team}}}:"

    def _keys(self, team: str, conversation_id: str) -> list[str]:
        prefix = self._prefix(team)
        return [prefix + conversation_id, prefix + conversation_id + ":items", prefix + "index"]

    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    async def _call(self, work: Any) -> Any:
        """`work` (a coroutine of the client's) bounded in time; a failure `Unavailable`."""
        try:
            async with self.redis._bounded():
                return await work
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"The conversation store failed: {error}") from None

    async def create(self, team: str, conversation: dict[str, Any], items: list[Item]) -> None:
        conversation_id = str(conversation["id"])
        args: list[bytes | str | int] = [
            orjson.dumps(conversation),
            self._ttl_ms(),
            int(time.time() * 1000),
            self.per_team,
            conversation_id,
            self._prefix(team),
            *(orjson.dumps(item) for item in items),
        ]
        await self._call(self._create(keys=self._keys(team, conversation_id), args=args))

    async def _read(self, team: str, conversation_id: str) -> tuple[bytes | None, list[bytes]]:
        """The object's and the items' JSON, read in one step."""
        key, items, _ = self._keys(team, conversation_id)
        pipe = self.redis.client.pipeline(transaction=True)
        pipe.get(key)
        pipe.lrange(items, 0, -1)
        raw, raws = await self._call(pipe.execute())
        return raw, list(raws)

    async def get(self, team: str, conversation_id: str) -> dict[str, Any] | None:
        key = self._keys(team, conversation_id)[0]
        raw = await self._call(self.redis.client.get(key))
        return None if raw is None else dict(orjson.loads(raw))

    async def items(self, team: str, conversation_id: str) -> list[Item] | None:
        raw, raws = await self._read(team, conversation_id)
        return None if raw is None else [orjson.loads(item) for item in raws]

    async def _changed(
        self, team: str, conversation_id: str, value: bytes, items: Sequence[Item], limit: int
    ) -> int:
        args: list[bytes | str | int] = [
            self._ttl_ms(),
            int(time.time() * 1000),
            conversation_id,
            limit,
            value,
            *(orjson.dumps(item) for item in items),
        ]
        held = await self._call(self._change(keys=self._keys(team, conversation_id), args=args))
        return int(held)

    async def update(
        self, team: str, conversation_id: str, metadata: dict[str, str]
    ) -> dict[str, Any] | None:
        found = await self.get(team, conversation_id)
        if found is None:
            return None
        conversation = {**found, "metadata": metadata}
        held = await self._changed(team, conversation_id, orjson.dumps(conversation), (), 0)
        return None if held == -1 else conversation

    async def append(
        self, team: str, conversation_id: str, items: Sequence[Item], limit: int
    ) -> bool:
        held = await self._changed(team, conversation_id, b"", items, limit)
        if held <= -2:
            raise Full(-2 - held)
        return held >= 0

    async def delete(self, team: str, conversation_id: str) -> bool:
        key, items, index = self._keys(team, conversation_id)
        pipe = self.redis.client.pipeline(transaction=True)
        pipe.delete(key, items)
        pipe.zrem(index, conversation_id)
        removed, _ = await self._call(pipe.execute())
        return bool(removed)

    async def delete_item(self, team: str, conversation_id: str, item_id: str) -> bool | None:
        raw, raws = await self._read(team, conversation_id)
        if raw is None:
            return None
        found = next((item for item in raws if _id_of(item) == item_id), None)
        if found is None:
            return False
        # LREM takes out that very value, or nothing where another request took it first
        items = self._keys(team, conversation_id)[1]
        value = found if isinstance(found, str) else found.decode()
        return bool(await self._call(self.redis.client.lrem(items, 1, value)))


def open_conversations(
    redis: RedisStore | None, ttl: float, per_team: int, max_items: int
) -> ConversationStore:
    """The conversations of this gateway: in Redis when it has one, else in its memory
    (store.py's `open_store` warns about that for both)."""
    if redis is not None:
        return RedisConversations(redis, ttl, per_team, max_items)
    return MemoryConversations(ttl, per_team, max_items)


def not_found(conversation_id: str, param: str = "conversation_id") -> APIError:
    """OpenAI's 404 for a conversation id no store holds (`param`: how it was named)."""
    return APIError(
        404,
        f"Conversation with id '{conversation_id[:128]}' not found.",
        param=param,
        code="not_found",
    )


async def conversation_history(store: ConversationStore, team: str, value: Any) -> list[Item]:
    """The items of the conversation a body's `conversation` names (its id, or
    `{"id": ...}`), in order: the history a turn of it follows. A 400 naming
    `conversation` for a value that is not one, a 404 for a conversation the team does
    not have; a failing store's `Unavailable` as it comes."""
    found = await store.items(team, conversation_id(value))
    if found is None:
        raise not_found(conversation_id(value), "conversation")
    return found
