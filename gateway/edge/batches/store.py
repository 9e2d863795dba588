"""Where the Batch API keeps its files and batches, per team: this process's memory, or
Redis (`redis_url`), shared by every replica.

What is kept:
- a file: its object (OpenAI's File: id, bytes, filename, purpose, times) and its
  content, a list of byte chunks: an upload's 1 MiB pieces, or a batch's output lines
  as they are written (a batch's output and error files exist, hidden, from its start,
  and are shown once it ends);
- a batch: its object (OpenAI's Batch) with its status, the ids of its output and
  error files, and which of its input lines are done (so a run picks up after the
  last line recorded, wherever it resumes). Its `request_counts` are read from those:
  completed is its output file's lines, failed its error file's.

Recording a line is one step (a line marked done and its output appended, or neither),
and a change of status a compare-and-set (`update`: written only from the states named),
so a cancel racing the end of a run stays what came first.

Redis keys (`P` is `redis_key_prefix`; `{team}` a hash tag, one slot per team):

    P:batches:{team}:file:ID      the file object (JSON), expiring with the file
    P:batches:{team}:blob:ID      its content, a list of chunks
    P:batches:{team}:files        sorted set of the team's file ids by creation
    P:batches:{team}:batch:ID     the batch object and its files' ids (JSON)
    P:batches:{team}:status:ID    its status, the compare-and-set's subject
    P:batches:{team}:done:ID      a bitmap of its input lines recorded
    P:batches:{team}:sums:ID      a hash of what its lines recorded add up to (SUMS)
    P:batches:{team}:batches      sorted set of the team's batch ids by creation
    P:batches:running             set of the batches running ("team/id"), any replica's
    P:batches:owner:TEAM/ID       the replica running it, a lease it renews

Bounds: files and batches expire `ttl` seconds after they were made (OpenAI keeps
batch files 30 days); at most `per_team` files a team (an upload past it is a 400
asking to delete some); this process's memory holds at most `MEMORY_BYTES_PER_TEAM`
bytes of files a team, its uploads and its batches' output alike (`room`: an answer past
it is recorded as the line's error instead). Redis is bounded by its own `maxmemory`, as
its operator sets it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.protocol import errors

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.batches")

#: A line's usage, or a batch's sums: name → count.
Tokens = dict[str, int]

#: The most bytes of files (uploads and batches' output) a team keeps in a gateway's memory.
MEMORY_BYTES_PER_TEAM = 1024 * 1024 * 1024
#: Seconds more a Redis call may take for each byte it moves (a file's upload or
#: download: 100 MiB at 20 MB/s, 5 s), past `redis_timeout`.
SECONDS_A_BYTE = 1 / 20e6
#: A file's pieces read from Redis a call (uploads keep 1 MiB pieces; a batch's output, a
#: line a piece): what one download holds at a time.
PAGE, CHUNK_BYTES = 16, 1024 * 1024
#: A batch's states before its end, and the ends.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("failed", "completed", "expired", "cancelled")


@dataclass(slots=True)
class StoredBatch:
    """One batch: its public object in OpenAI's shape (`request_counts` as last
    written), the ids of its output and error files, hidden until it ends, how long those
    are kept once shown (`output_expires_after`; None: as long as the batch), the API
    it was made with (`openai`, or `anthropic`: Message Batches, whose input is a hidden
    file too), and how many of its lines expired."""

    batch: dict[str, Any]
    output: str
    errors: str
    output_ttl: int | None = None
    api: str = "openai"
    expired: int = 0

    @property
    def id(self) -> str:
        return str(self.batch["id"])

    @property
    def status(self) -> str:
        return str(self.batch["status"])

    def dumps(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> StoredBatch:
        return cls(**orjson.loads(raw))


#: What a batch's lines add up to as they are recorded, so that its end reads no file
#: back: its output's and error file's bytes, and its answers' usage (`record`'s `tokens`).
SUMS = (
    "output_bytes",
    "error_bytes",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "cached_tokens",
    "reasoning_tokens",
)


def pieces(content: bytes) -> list[bytes]:
    """A file's content in the `CHUNK_BYTES` pieces the stores keep (a download then
    holds a page of them at a time, not the file)."""
    return [content[i : i + CHUNK_BYTES] for i in range(0, len(content), CHUNK_BYTES)]


@dataclass(slots=True)
class Progress:
    """A batch's input lines recorded so far, its output and error lines counted, and
    what they add up to (SUMS)."""

    done: set[int] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    sums: dict[str, int] = field(default_factory=dict)


def _adds(out: bytes, ok: bool, tokens: dict[str, int]) -> dict[str, int]:
    """What recording `out` adds to its batch's sums."""
    return {"output_bytes" if ok else "error_bytes": len(out), **tokens}


def _failed(error: Exception) -> errors.Unavailable:
    return errors.Unavailable(f"The batch store failed: {error}")


class BatchStore:
    """The Batch API's files and batches, per team (an open gateway's are team "")."""

    #: Whether other replicas share it (and may change a batch this one runs).
    shared = False

    def __init__(self, ttl: float, per_team: int) -> None:
        self.ttl = ttl
        self.per_team = per_team

    async def put_file(
        self,
        team: str,
        file: dict[str, Any],
        chunks: list[bytes],
        ttl: int | None = None,
        hidden: bool = False,
    ) -> None:
        """Keeps a new file for `ttl` seconds (None: the store's); a 400 (`Invalid`) past
        the team's bounds. A `hidden` one (a Message Batch's requests) has content only,
        listed nowhere, counted in no bound but the memory's."""
        raise NotImplementedError

    async def file(self, team: str, file_id: str) -> dict[str, Any] | None:
        """The team's file object, or None (never made, expired, deleted, another team's,
        or a batch's file not shown yet)."""
        raise NotImplementedError

    def pages(self, team: str, file_id: str) -> AsyncIterator[list[bytes]]:
        """A file's content, in chunks, a page of them at a time, so a download holds
        one page rather than the file (a batch's hidden files' too: a route shows only
        what `file` finds). A batch's output and error files hold a line a chunk."""
        raise NotImplementedError

    async def content(self, team: str, file_id: str) -> list[bytes]:
        """A file's whole content, in chunks."""
        return [chunk async for page in self.pages(team, file_id) for chunk in page]

    async def delete_file(self, team: str, file_id: str) -> bool:
        """Whether the team had the file (it is gone now)."""
        raise NotImplementedError

    async def files(self, team: str) -> list[dict[str, Any]]:
        """The team's file objects, oldest first."""
        raise NotImplementedError

    async def put_batch(self, team: str, stored: StoredBatch) -> None:
        """Keeps a new batch, with its hidden output and error files."""
        raise NotImplementedError

    async def batch(self, team: str, batch_id: str) -> StoredBatch | None:
        """The team's batch, its counts read from its progress, or None."""
        raise NotImplementedError

    async def batches(self, team: str) -> list[StoredBatch]:
        """The team's batches, oldest first."""
        raise NotImplementedError

    async def delete_batch(self, team: str, stored: StoredBatch) -> None:
        """Forgets an ended batch and its files (a Message Batch's delete)."""
        raise NotImplementedError

    async def update(self, team: str, stored: StoredBatch, states: tuple[str, ...]) -> str | None:
        """Writes `stored` over the team's batch of its id only if that one's status is
        one of `states`, in one step; returns that status (None: no such batch)."""
        raise NotImplementedError

    def room(self, team: str, size: int) -> bool:
        """Whether the store keeps `size` bytes more of `team`'s output."""
        return True

    async def record(
        self, team: str, stored: StoredBatch, line: int, out: bytes, ok: bool, tokens: Tokens
    ) -> None:
        """Marks input line `line` done and appends `out` to the output file (`ok`) or
        the error file, adding its bytes and `tokens` (its usage) to the batch's sums, in
        one step; a line already done is not appended again."""
        raise NotImplementedError

    async def progress(self, team: str, stored: StoredBatch) -> Progress:
        """The batch's lines done, its files' lines counted, and its sums."""
        raise NotImplementedError

    async def show(self, team: str, file: dict[str, Any], ttl: int | None = None) -> None:
        """Makes a batch's hidden output or error file a file of the team's (its object
        given; its content is what `record` appended), kept `ttl` seconds more (None: as
        long as the batch)."""
        raise NotImplementedError

    # Which replica runs which batch (shared stores only).

    async def claim(self, team: str, batch_id: str, owner: str, ttl: float) -> bool:
        """Takes the batch's run for `owner` for `ttl` seconds, unless another holds it."""
        return True

    async def renew(self, runs: Iterable[tuple[str, str]], owner: str, ttl: float) -> None:
        """Extends the leases of `owner`'s runs (team, id)."""

    async def release(self, team: str, batch_id: str, owner: str, ended: bool) -> None:
        """Gives the run up (`ended`: the batch is over, no one is to resume it)."""

    async def orphans(self, owner: str) -> list[tuple[str, str]]:
        """The running batches (team, id) that no replica holds, or `owner` holds (a run
        of its that stopped on a failure of the store): each to be resumed."""
        return []


class MemoryBatches(BatchStore):
    """This process's store (replicas do not share it; a restart forgets it)."""

    def __init__(self, ttl: float, per_team: int) -> None:
        super().__init__(ttl, per_team)
        #: team → file id → (expires, object, chunks); a hidden file's object is None.
        self._files: dict[str, dict[str, tuple[float, dict[str, Any] | None, list[bytes]]]] = {}
        #: team → batch id → (expires, batch, its lines done, its sums).
        self._batches: dict[str, dict[str, tuple[float, StoredBatch, set[int], Tokens]]] = {}
        #: team → the bytes its files hold (uploads and output).
        self._held: dict[str, int] = {}

    def _team_files(self, team: str) -> dict[str, tuple[float, dict[str, Any] | None, list[bytes]]]:
        kept = self._files.setdefault(team, {})
        now = time.monotonic()
        for file_id in [k for k, (expires, _, _) in kept.items() if expires <= now]:
            self._drop(team, file_id)
        return kept

    def _drop(self, team: str, file_id: str) -> None:
        """Forgets a file of `team`'s, and the bytes it held."""
        found = self._files.get(team, {}).pop(file_id, None)
        if found is not None:
            self._held[team] -= sum(map(len, found[2]))

    def room(self, team: str, size: int) -> bool:
        # its expired files leave the count at the team's next look (`record`, `put_file`
        # sweep them), not in a walk of all its files a line more
        return self._held.get(team, 0) + size <= MEMORY_BYTES_PER_TEAM

    def _team_batches(self, team: str) -> dict[str, tuple[float, StoredBatch, set[int], Tokens]]:
        kept = self._batches.setdefault(team, {})
        now = time.monotonic()
        for batch_id in [k for k, (expires, *_) in kept.items() if expires <= now]:
            del kept[batch_id]
        return kept

    async def put_file(
        self,
        team: str,
        file: dict[str, Any],
        chunks: list[bytes],
        ttl: int | None = None,
        hidden: bool = False,
    ) -> None:
        kept = self._team_files(team)
        shown = sum(1 for _, obj, _ in kept.values() if obj is not None)
        if shown >= self.per_team and not hidden:
            raise too_many(self.per_team)
        size = sum(map(len, chunks))
        if not self.room(team, size):
            raise errors.Invalid(
                f"This team's files hold {self._held[team]} bytes of the gateway's memory, "
                f"and at most {MEMORY_BYTES_PER_TEAM} are kept; delete some files or "
                "batches first.",
                param="file",
            )
        expires = time.monotonic() + (self.ttl if ttl is None else ttl)
        self._drop(team, file["id"])
        kept[file["id"]] = (expires, None if hidden else file, chunks)
        self._held[team] = self._held.get(team, 0) + size

    async def file(self, team: str, file_id: str) -> dict[str, Any] | None:
        found = self._team_files(team).get(file_id)
        return None if found is None else found[1]

    async def pages(self, team: str, file_id: str) -> AsyncIterator[list[bytes]]:
        found = self._team_files(team).get(file_id)
        if found is not None:  # in memory already: one page
            yield list(found[2])

    async def delete_file(self, team: str, file_id: str) -> bool:
        found = self._team_files(team).get(file_id)
        if found is None or found[1] is None:
            return False
        self._drop(team, file_id)
        return True

    async def files(self, team: str) -> list[dict[str, Any]]:
        kept = self._team_files(team).values()
        return sorted((obj for _, obj, _ in kept if obj is not None), key=_created)

    async def put_batch(self, team: str, stored: StoredBatch) -> None:
        expires = time.monotonic() + self.ttl
        files = self._team_files(team)
        for file_id in (stored.output, stored.errors):
            self._drop(team, file_id)
            files[file_id] = (expires, None, [])
        self._team_batches(team)[stored.id] = (expires, _copy(stored), set(), {})

    async def batch(self, team: str, batch_id: str) -> StoredBatch | None:
        found = self._team_batches(team).get(batch_id)
        return None if found is None else self._as_now(team, found[1])

    async def batches(self, team: str) -> list[StoredBatch]:
        found = [self._as_now(team, s) for _, s, *_ in self._team_batches(team).values()]
        return sorted(found, key=lambda s: _created(s.batch))

    def _as_now(self, team: str, kept: StoredBatch) -> StoredBatch:
        """A copy of the batch, its counts read from its files (the team's swept already)."""
        stored, files = _copy(kept), self._files.get(team, {})
        output, errors_ = files.get(stored.output), files.get(stored.errors)
        progress = Progress(
            set(),
            0 if output is None else len(output[2]),
            0 if errors_ is None else len(errors_[2]),
        )
        stored.batch["request_counts"] = counts(stored.batch, progress)
        return stored

    async def delete_batch(self, team: str, stored: StoredBatch) -> None:
        self._team_batches(team).pop(stored.id, None)
        self._team_files(team)
        for file_id in (stored.output, stored.errors):
            self._drop(team, file_id)
        if stored.api == "anthropic":  # its requests, a hidden file of its own
            self._drop(team, stored.batch["input_file_id"])

    async def update(self, team: str, stored: StoredBatch, states: tuple[str, ...]) -> str | None:
        kept = self._team_batches(team)
        found = kept.get(stored.id)
        if found is None:
            return None
        status = found[1].status
        if status in states:
            kept[stored.id] = (found[0], _copy(stored), found[2], found[3])
        return status

    async def record(
        self, team: str, stored: StoredBatch, line: int, out: bytes, ok: bool, tokens: Tokens
    ) -> None:
        found = self._team_batches(team).get(stored.id)
        blob = self._team_files(team).get(stored.output if ok else stored.errors)
        if found is None or blob is None or line in found[2]:
            return
        found[2].add(line)
        blob[2].append(out)
        sums = found[3]
        for name, value in _adds(out, ok, tokens).items():
            sums[name] = sums.get(name, 0) + value
        self._held[team] = self._held.get(team, 0) + len(out)

    async def progress(self, team: str, stored: StoredBatch) -> Progress:
        found = self._team_batches(team).get(stored.id)
        files = self._team_files(team)
        output, errors_ = files.get(stored.output), files.get(stored.errors)
        return Progress(
            set() if found is None else set(found[2]),
            0 if output is None else len(output[2]),
            0 if errors_ is None else len(errors_[2]),
            {} if found is None else dict(found[3]),
        )

    async def show(self, team: str, file: dict[str, Any], ttl: int | None = None) -> None:
        files = self._team_files(team)
        found = files.get(file["id"])
        if found is not None:
            expires = found[0] if ttl is None else time.monotonic() + ttl
            files[file["id"]] = (expires, file, found[2])


def _created(obj: dict[str, Any]) -> int:
    """The sort key of a team's files and batches: when made (a stable sort keeps those
    of one second in the order they were made)."""
    return int(obj["created_at"])


def _copy(stored: StoredBatch) -> StoredBatch:
    return StoredBatch.loads(stored.dumps())


def counts(batch: dict[str, Any], progress: Progress) -> dict[str, int]:
    """A batch's `request_counts` as its progress says."""
    total = int(batch["request_counts"]["total"])
    return {"total": total, "completed": progress.completed, "failed": progress.failed}


def too_many(per_team: int) -> errors.Invalid:
    return errors.Invalid(
        f"This team has {per_team} files, the most the gateway keeps; delete some first.",
        param="file",
    )


#: `record`: KEYS the done bitmap, the blob, the sums; ARGV the line, the output line,
#: the TTL (ms: they live as long as the batch), then the sums' names and what they add.
_RECORD = """
if redis.call('SETBIT', KEYS[1], ARGV[1], 1) == 1 then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
for i = 4, #ARGV, 2 do redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 1]) end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
"""

#: `update`: KEYS the status, the batch; ARGV the new status, the new value, the states.
_UPDATE = """
local status = redis.call('GET', KEYS[1])
if not status then return false end
for i = 3, #ARGV do
  if ARGV[i] == status then
    redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
    redis.call('SET', KEYS[2], ARGV[2], 'KEEPTTL')
    return status
  end
end
return status
"""

#: `put_file`: KEYS the index, the object, the blob; ARGV the id, now (ms), the TTL
#: (ms), the bound, the object (empty: a hidden file, content only), then the chunks.
#: Expired ids leave the index first.
_PUT_FILE = """
if ARGV[5] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
  if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
    -- files that expired early (their `expires_after`) leave the count first
    local prefix = string.sub(KEYS[2], 1, #KEYS[2] - #ARGV[1])
    for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
      if redis.call('EXISTS', prefix .. id) == 0 then redis.call('ZREM', KEYS[1], id) end
    end
    if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
  end
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[3])
end
redis.call('DEL', KEYS[3])
for i = 6, #ARGV do redis.call('RPUSH', KEYS[3], ARGV[i]) end
if #ARGV >= 6 then redis.call('PEXPIRE', KEYS[3], ARGV[3]) end
return 1
"""

#: `claim`: KEYS the owner; ARGV the owner, the TTL (ms).
_CLAIM = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

#: `release`: KEYS the owner; ARGV the owner.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class RedisBatches(BatchStore):
    """The store every replica shares, on the teams' Redis client; a failure is
    `Unavailable` (503) for the request that needed it."""

    shared = True

    def __init__(self, redis: RedisStore, ttl: float, per_team: int) -> None:
        super().__init__(ttl, per_team)
        self.redis = redis
        self._record = redis.script(_RECORD)
        self._update = redis.script(_UPDATE)
        self._put_file = redis.script(_PUT_FILE)
        self._claim = redis.script(_CLAIM)
        self._release = redis.script(_RELEASE)

    def _key(self, team: str, what: str) -> str:
        return f"{self.redis.prefix}:batches:{{{team}}}:{what}"

    def _owner(self, team: str, batch_id: str) -> str:
        return f"{self.redis.prefix}:batches:owner:{team}/{batch_id}"

    @property
    def _running(self) -> str:
        return f"{self.redis.prefix}:batches:running"

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    async def _call(self, method: str, *args: Any, extra: float = 0.0, **kwargs: Any) -> Any:
        """One Redis call, bounded (`extra` seconds more than a call), its failure
        `Unavailable`."""
        try:
            async with self.redis._bounded(extra):
                return await getattr(self.redis.client, method)(*args, **kwargs)
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None

    async def _script(
        self, script: Any, keys: list[str], args: list[Any], extra: float = 0.0
    ) -> Any:
        try:
            async with self.redis._bounded(extra):
                return await script(keys=keys, args=args)
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None

    async def put_file(
        self,
        team: str,
        file: dict[str, Any],
        chunks: list[bytes],
        ttl: int | None = None,
        hidden: bool = False,
    ) -> None:
        keys = [
            self._key(team, "files"),
            self._key(team, "file:" + file["id"]),
            self._key(team, "blob:" + file["id"]),
        ]
        now_ms = int(time.time() * 1000)
        ttl_ms = self._ttl_ms if ttl is None else ttl * 1000
        head = [file["id"], now_ms, ttl_ms, self.per_team, b"" if hidden else orjson.dumps(file)]
        # a large upload's chunks go in one script: one step, as `record`'s lines
        extra = file["bytes"] * SECONDS_A_BYTE
        if not await self._script(self._put_file, keys, [*head, *chunks], extra):
            raise too_many(self.per_team)

    async def file(self, team: str, file_id: str) -> dict[str, Any] | None:
        raw = await self._call("get", self._key(team, "file:" + file_id))
        return None if raw is None else dict(orjson.loads(raw))

    async def pages(self, team: str, file_id: str) -> AsyncIterator[list[bytes]]:
        # each call bounded by what it may move: an upload's 1 MiB chunks
        key = self._key(team, "blob:" + file_id)
        extra, read = PAGE * CHUNK_BYTES * SECONDS_A_BYTE, 0
        while True:
            page = await self._call("lrange", key, read, read + PAGE - 1, extra=extra)
            read += len(page)
            if page:
                yield page
            if len(page) < PAGE:
                return

    async def delete_file(self, team: str, file_id: str) -> bool:
        keys = [self._key(team, "file:" + file_id), self._key(team, "blob:" + file_id)]
        removed = await self._call("delete", *keys)
        await self._call("zrem", self._key(team, "files"), file_id)
        return bool(removed)

    async def _objects(self, team: str, index: str, kind: str) -> list[bytes]:
        now_ms = int(time.time() * 1000)
        ids = await self._call(
            "zrangebyscore", self._key(team, index), now_ms - self._ttl_ms, "+inf"
        )
        if not ids:
            return []
        keys = [self._key(team, f"{kind}:{i.decode()}") for i in ids]
        return [raw for raw in await self._call("mget", keys) if raw is not None]

    async def files(self, team: str) -> list[dict[str, Any]]:
        return [orjson.loads(raw) for raw in await self._objects(team, "files", "file")]

    async def put_batch(self, team: str, stored: StoredBatch) -> None:
        ttl, now_ms = self._ttl_ms, int(time.time() * 1000)
        try:
            async with self.redis._bounded():
                pipe = self.redis.client.pipeline(transaction=True)
                pipe.set(self._key(team, "batch:" + stored.id), stored.dumps(), px=ttl)
                pipe.set(self._key(team, "status:" + stored.id), stored.status, px=ttl)
                pipe.zremrangebyscore(self._key(team, "batches"), "-inf", now_ms - ttl)
                pipe.zadd(self._key(team, "batches"), {stored.id: now_ms})
                pipe.pexpire(self._key(team, "batches"), ttl)
                await pipe.execute()
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None

    async def batch(self, team: str, batch_id: str) -> StoredBatch | None:
        raw = await self._call("get", self._key(team, "batch:" + batch_id))
        if raw is None:
            return None
        return (await self._as_now(team, [StoredBatch.loads(raw)]))[0]

    async def batches(self, team: str) -> list[StoredBatch]:
        raws = await self._objects(team, "batches", "batch")
        return await self._as_now(team, [StoredBatch.loads(raw) for raw in raws])

    async def _as_now(self, team: str, found: list[StoredBatch]) -> list[StoredBatch]:
        """The batches with their counts as they are now, in one round trip. (Not their
        status: a batch's object is written with its status in one step, and a status
        read after the object could pair a batch's end with the object of before it.)"""
        try:
            async with self.redis._bounded():
                pipe = self.redis.client.pipeline(transaction=False)
                for stored in found:
                    pipe.llen(self._key(team, "blob:" + stored.output))
                    pipe.llen(self._key(team, "blob:" + stored.errors))
                replies = await pipe.execute()
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None
        for i, stored in enumerate(found):
            completed, failed = replies[2 * i : 2 * i + 2]
            progress = Progress(set(), completed, failed)
            stored.batch["request_counts"] = counts(stored.batch, progress)
        return found

    async def delete_batch(self, team: str, stored: StoredBatch) -> None:
        kinds = ("batch", "status", "done", "sums")
        keys = [self._key(team, f"{what}:{stored.id}") for what in kinds]
        for file_id in (stored.output, stored.errors):
            keys += [self._key(team, "file:" + file_id), self._key(team, "blob:" + file_id)]
        if stored.api == "anthropic":  # its requests, a hidden file of its own
            keys.append(self._key(team, "blob:" + stored.batch["input_file_id"]))
        await self._call("delete", *keys)
        await self._call("zrem", self._key(team, "batches"), stored.id)
        await self._call("zrem", self._key(team, "files"), stored.output, stored.errors)

    async def update(self, team: str, stored: StoredBatch, states: tuple[str, ...]) -> str | None:
        keys = [self._key(team, "status:" + stored.id), self._key(team, "batch:" + stored.id)]
        status = await self._script(self._update, keys, [stored.status, stored.dumps(), *states])
        if status is None:
            return None
        return status.decode() if isinstance(status, bytes) else str(status)

    async def record(
        self, team: str, stored: StoredBatch, line: int, out: bytes, ok: bool, tokens: Tokens
    ) -> None:
        blob = self._key(team, "blob:" + (stored.output if ok else stored.errors))
        keys = [self._key(team, "done:" + stored.id), blob, self._key(team, "sums:" + stored.id)]
        adds = [x for pair in _adds(out, ok, tokens).items() for x in pair]
        extra = len(out) * SECONDS_A_BYTE
        await self._script(self._record, keys, [line, out, self._ttl_ms, *adds], extra)

    async def progress(self, team: str, stored: StoredBatch) -> Progress:
        try:
            async with self.redis._bounded():
                pipe = self.redis.client.pipeline(transaction=False)
                pipe.get(self._key(team, "done:" + stored.id))
                pipe.llen(self._key(team, "blob:" + stored.output))
                pipe.llen(self._key(team, "blob:" + stored.errors))
                pipe.hgetall(self._key(team, "sums:" + stored.id))
                bitmap, completed, failed, sums = await pipe.execute()
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None
        sums = {name.decode(): int(value) for name, value in sums.items()}
        return Progress(lines_set(bitmap or b""), completed, failed, sums)

    async def show(self, team: str, file: dict[str, Any], ttl: int | None = None) -> None:
        key = self._key(team, "file:" + file["id"])
        now_ms = int(time.time() * 1000)
        # as long as its lines live (the batch's) unless told
        left = await self._call("pttl", self._key(team, "blob:" + file["id"]))
        ttl_ms = (left if left > 0 else self._ttl_ms) if ttl is None else ttl * 1000
        try:
            async with self.redis._bounded():
                pipe = self.redis.client.pipeline(transaction=True)
                pipe.set(key, orjson.dumps(file), px=ttl_ms)
                pipe.zadd(self._key(team, "files"), {file["id"]: now_ms})
                pipe.pexpire(self._key(team, "blob:" + file["id"]), ttl_ms)
                await pipe.execute()
        except (OSError, TimeoutError) as error:
            raise _failed(error) from None

    async def claim(self, team: str, batch_id: str, owner: str, ttl: float) -> bool:
        ms = max(1, int(ttl * 1000))
        held = await self._script(self._claim, [self._owner(team, batch_id)], [owner, ms])
        if held:
            await self._call("sadd", self._running, f"{team}/{batch_id}")
        return bool(held)

    async def renew(self, runs: Iterable[tuple[str, str]], owner: str, ttl: float) -> None:
        ms = max(1, int(ttl * 1000))
        for team, batch_id in runs:
            await self._script(self._claim, [self._owner(team, batch_id)], [owner, ms])

    async def release(self, team: str, batch_id: str, owner: str, ended: bool) -> None:
        if ended:
            await self._call("srem", self._running, f"{team}/{batch_id}")
        await self._script(self._release, [self._owner(team, batch_id)], [owner])

    async def orphans(self, owner: str) -> list[tuple[str, str]]:
        running = sorted(m.decode() for m in await self._call("smembers", self._running))
        if not running:
            return []
        owners = await self._call(
            "mget", [f"{self.redis.prefix}:batches:owner:{run}" for run in running]
        )
        found = []
        for run, holder in zip(running, owners, strict=True):
            if holder is None or holder.decode() == owner:
                team, _, batch_id = run.rpartition("/")
                found.append((team, batch_id))
        return found


def lines_set(bitmap: bytes) -> set[int]:
    """The positions set in a Redis bitmap (its first bit the most significant)."""
    found = set()
    for byte_at, byte in enumerate(bitmap):
        if byte:
            for bit in range(8):
                if byte & (0x80 >> bit):
                    found.add(byte_at * 8 + bit)
    return found


def open_batches(redis: RedisStore | None, ttl: float, per_team: int) -> BatchStore:
    """Redis's store when the gateway has one, else this process's memory."""
    if redis is not None:
        return RedisBatches(redis, ttl, per_team)
    log.warning(
        "batches and their files (/v1/batches, /v1/files) are kept in this process's "
        "memory: replicas and processes do not share them, and a restart loses them with "
        "their runs (set redis_url to share them and resume runs on another replica)"
    )
    return MemoryBatches(ttl, per_team)
