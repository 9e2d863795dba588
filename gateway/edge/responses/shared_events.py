"""A streamed background response's events kept in Redis too (with `redis_url`), so
that a client whose connection dropped resumes it through any replica sharing the
store (`GET /v1/responses/{id}?stream=true&starting_after=N`), not only the one that
runs it: behind a Kubernetes Service, a reconnect lands on a random replica.

The replica that runs the response keeps serving its own readers from memory
(replay.py); Redis holds a copy, one Stream a response (`P` is `redis_key_prefix`):

    P:responses:{team}:ID:events   entry `N-1`: event N (field `e`, its SSE block);
                                   after the last event, an entry with field `end`

The entry ids are the sequence numbers, so a reader asks for what follows N by id
and sees at once whether something is missing, and writing an entry again is refused
by Redis (a retry of what did land changes nothing). Bounds: the copy holds what the
running process's log holds (at most `LOG_BYTES`; older entries trimmed with XTRIM
MINID in the same script), lives until the run's latest possible end, and
`KEPT_AFTER` seconds after its end once that is written.

Writing costs the run nothing on its path: the run's send marks its mirror changed
(a dict store and an `Event.set`); one task per process writes every changed
mirror's new events in one pipeline, one Lua script a run (XADD each, XTRIM, PEXPIRE;
the end marker once the run ended), at most every `FLUSH` seconds: one round trip for
all the process's streamed runs, and what comes while one is in flight (or within
`FLUSH`) goes in the next. Measured with a real Redis on loopback: the run's side
~0.2-0.5 µs a send; the writer ~25 µs of CPU an event for one stream of a token a
millisecond, 2-4 µs an event with 5 tokens a turn or 16 such streams (one round trip
costs redis-py ~100 µs, shared by what it carries). The POST writes the first event
(`response.created`, queued) with the stored response in one round trip, so the key
exists as soon as the client has the response's id.

Redis failing: the run goes on and its own readers are served from memory. The
writer logs it once, and writes again from where it was every `RETRY` seconds (what
the log dropped meanwhile is trimmed from Redis too: a reader past it is cut, and a
resume from before it refused by `starting_after`); an ended run whose end is still
not written `GIVE_UP` seconds after it is given up (logged). Another replica then
refuses a resume clearly: a 503 while it cannot read the store, a 400 naming
`stream` once the response ended without its end marker in Redis.

Reading on another replica: XRANGE for the first and last entries (the 400s), then
XREAD BLOCK from N, in blocks of half `redis_timeout` (each call is bounded by it),
looping until the end marker; a keep-alive comment every `keepalive_interval` of
quiet, when the stored response is read again: a reader whose response ended (or was
lost with its replica) with no end marker stops after one more quiet interval. Every
follow is bounded by the longest a run may take, and its client leaving cancels it
(Starlette's stream cancels the generator, redis-py drops the connection of a call
cut short).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from itertools import islice
from typing import Any

from starlette.responses import Response, StreamingResponse

from gateway.edge.errors import from_error, invalid
from gateway.edge.responses.replay import KEEPALIVE, KEPT_AFTER, LOG_BYTES, EventLog
from gateway.edge.responses.store import UNFINISHED, RedisResponses, Stored, run_scripts
from gateway.protocol import errors

log = logging.getLogger("furnace.responses")

#: Seconds between tries to write while Redis does not answer.
RETRY = 1.0
#: The least seconds between two writes: what comes meanwhile goes in one round trip
#: (a round trip costs redis-py ~100 µs of CPU; a stream of a token a millisecond
#: would pay it on every token). Readers on other replicas lag by at most this.
FLUSH = 0.02
#: Seconds after its end that a run's events are still tried (its end marker unwritten).
GIVE_UP = 30.0
#: The most entries one XREAD returns.
READ_COUNT = 1000
#: Seconds a reader waits for an end marker when the stored response ended without one.
SETTLE = 2.0

#: KEYS[1] the events; ARGV[1] the sequence number of the first block given, ARGV[2]
#: the first kept (older entries trimmed), ARGV[3] ms the key lives, ARGV[4] '1' to
#: add the end marker after the blocks, ARGV[5..] the blocks. An entry already there
#: (a retry) is refused by XADD, and skipped; any other refusal (Redis out of memory)
#: fails the script, to be tried again.
_WRITE = """
local function add(seq, field, value)
  local r = redis.pcall('XADD', KEYS[1], string.format('%d-1', seq), field, value)
  if type(r) == 'table' and r.err and not string.find(r.err, 'equal or smaller', 1, true) then
    return r
  end
end
local seq = tonumber(ARGV[1])
for i = 5, #ARGV do
  local failed = add(seq, 'e', ARGV[i])
  if failed then return failed end
  seq = seq + 1
end
if ARGV[4] == '1' then
  local failed = add(seq, 'end', '1')
  if failed then return failed end
end
redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-1', tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return seq
"""


class Mirror:
    """One streamed run's events on their way to Redis: `written` is the sequence
    number of the first not yet written."""

    __slots__ = ("deadline", "ended_at", "key", "log", "response_id", "shared", "written")

    def __init__(
        self, shared: SharedEvents, key: str, response_id: str, log: EventLog, deadline: float
    ) -> None:
        self.shared, self.key, self.response_id, self.log = shared, key, response_id, log
        self.deadline = deadline  # wall clock: the run's latest possible end
        self.written = log.next_seq
        self.ended_at = 0.0

    def changed(self) -> None:
        """The run wrote (called once a loop turn's send, not per event)."""
        shared = self.shared
        if shared.mirrors.get(self.response_id) is self:  # not given up
            shared.pending[self.response_id] = self
            shared.wake.set()

    def end(self) -> None:
        self.ended_at = time.monotonic()
        self.changed()


class SharedEvents:
    """This process's streamed runs' events, written to Redis by one task (see the
    module docstring), and the reader of those other replicas run."""

    def __init__(self, store: RedisResponses, detached: set[asyncio.Task[Any]]) -> None:
        self.store = store
        self.detached = detached
        self.script = store.redis.script(_WRITE)
        self.mirrors: dict[str, Mirror] = {}
        self.pending: dict[str, Mirror] = {}
        self.wake = asyncio.Event()
        self.up = True
        #: Resumes being served from Redis now (the leak checks read it).
        self.readers = 0
        self._task: asyncio.Task[None] | None = None

    def key(self, team: str, response_id: str) -> str:
        return f"{self.store.redis.prefix}:responses:{{{team}}}:{response_id}:events"

    # -- writing ------------------------------------------------------------------------

    async def open(self, team: str, stored: Stored, created: bytes, deadline: float) -> None:
        """Stores the queued response and its stream's first event in one round trip
        (`Unavailable` as the store's put)."""
        args = [0, 0, _ttl_ms(deadline), "", created]
        also = (self.script, [self.key(team, stored.id)], args)
        await self.store.put(team, stored, also)

    def add(self, team: str, response_id: str, log: EventLog, deadline: float) -> Mirror:
        """A streamed run whose first events `open` wrote."""
        mirror = self.mirrors[response_id] = Mirror(
            self, self.key(team, response_id), response_id, log, deadline
        )
        if self._task is None:
            task = self._task = asyncio.ensure_future(self._write_all())
            self.detached.add(task)  # the drain waits for the last writes
            task.add_done_callback(self.detached.discard)
        return mirror

    async def _write_all(self) -> None:
        """While mirrors exist: each turn, what changed since the last, in one round trip."""
        try:
            while self.mirrors:
                if not self.pending:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                began = time.monotonic()
                batch = list(self.pending.values())
                self.pending.clear()
                try:
                    async with self.store.redis._bounded():
                        done = await self._write(batch)
                except (OSError, TimeoutError) as error:
                    self._failed(batch, error)
                    await asyncio.sleep(RETRY)
                    continue
                if not self.up:
                    self.up = True
                    log.info("background streams' events are written to Redis again")
                for mirror in done:
                    self.mirrors.pop(mirror.response_id, None)
                pause = began + FLUSH - time.monotonic()
                if pause > 0 and self.mirrors:
                    await asyncio.sleep(pause)
        finally:
            self._task = None
            self.mirrors.clear()  # none left, or cancelled: the drain's last resort
            self.pending.clear()

    async def _write(self, batch: list[Mirror]) -> list[Mirror]:
        """The batch's new events, one script a mirror in one pipeline; the mirrors
        whose end it wrote."""
        calls, sent = [], []
        for mirror in batch:
            events = mirror.log
            start = max(mirror.written, events.first)
            upto, ended = events.next_seq, events.ended
            if start == upto and not ended:
                continue
            ttl = int(KEPT_AFTER * 1000) if ended else _ttl_ms(mirror.deadline)
            blocks = islice(events.events, start - events.first, None)
            args = [start, events.first, ttl, "1" if ended else "", *blocks]
            calls.append((self.script, [mirror.key], args))
            sent.append((mirror, upto, ended))
        if calls:
            await run_scripts(self.store.redis.client, calls)
        for mirror, upto, _ in sent:
            mirror.written = upto
        return [mirror for mirror, _, ended in sent if ended]

    def _failed(self, batch: list[Mirror], error: BaseException) -> None:
        if self.up:
            self.up = False
            log.warning(
                "background streams' events not written to Redis (tried again every %gs; "
                "resumes on other replicas wait, then are refused): %s",
                RETRY,
                error,
            )
        now = time.monotonic()
        for mirror in batch:
            if mirror.ended_at and now - mirror.ended_at > GIVE_UP:
                log.warning(
                    "background response %s: its events were not all written to Redis",
                    mirror.response_id,
                )
                self.mirrors.pop(mirror.response_id, None)
            else:
                self.pending.setdefault(mirror.response_id, mirror)

    # -- reading ------------------------------------------------------------------------

    async def resume(
        self,
        team: str,
        found: Stored,
        after: int,
        keepalive: float,
        longest: float,
        retry_after: int | None,
    ) -> Response:
        """The stream after event `after` (-1: all) of a response another replica runs
        (or ran), or a 400 naming what cannot be served."""
        key = self.key(team, found.id)
        try:
            head = await self._head(key)
            if head is not None and not head[2] and found.status not in UNFINISHED:
                await asyncio.sleep(SETTLE)  # its end marker may be on its way
                head = await self._head(key)
        except (OSError, TimeoutError) as error:
            failure = errors.Unavailable(f"The response store failed: {error}")
            raise from_error(failure, retry_after) from None
        if head is None:
            raise invalid(
                "stream",
                "This response's events are not kept: only a background response created "
                f"with 'stream' keeps them, until {KEPT_AFTER:g} seconds after its end; "
                "read it without 'stream'.",
            )
        first, last, ended = head
        if not ended and found.status not in UNFINISHED and after >= last:
            raise invalid(
                "stream",
                "This response's events were not all kept in the shared store (it did not "
                "answer while the response ran); read it without 'stream'.",
            )
        if after + 1 < first:
            raise invalid(
                "starting_after",
                f"The events before {first} are no longer kept (at most "
                f"{LOG_BYTES} bytes of a response's events are).",
            )
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        if ended and after + 1 >= last:  # nothing after it: the stream is over
            return Response(b"", media_type="text/event-stream", headers=headers)
        # ended without its end marker: its reader stops after one quiet interval
        over = not ended and found.status not in UNFINISHED
        events = self._follow(team, found.id, key, after, (keepalive, longest), over)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _head(self, key: str) -> tuple[int, int, bool] | None:
        """The first and last entries' sequence numbers and whether the last is the
        end marker; None without the key."""
        redis = self.store.redis
        async with redis._bounded():
            pipe = redis.client.pipeline(transaction=False)
            pipe.xrange(key, count=1)
            pipe.xrevrange(key, count=1)
            first, last = await pipe.execute()
        if not first or not last:
            return None
        ended = b"end" in last[0][1]
        return _seq(first[0][0]), _seq(last[0][0]), ended

    async def _follow(
        self,
        team: str,
        response_id: str,
        key: str,
        after: int,
        bounds: tuple[float, float],
        over: bool,
    ) -> AsyncIterator[bytes]:
        """The events after `after` as they come, until the end marker, a gap, the
        bound (`bounds`: the keep-alive interval, the longest it may follow), or the
        store failing; `over`: the response ended already."""
        redis = self.store.redis
        keepalive, longest = bounds
        block_ms = max(1, int(redis.timeout * 500))
        expect = after + 1
        cursor: bytes | str = f"{after}-1" if after >= 0 else "0-0"
        until = time.monotonic() + longest
        quiet_since = time.monotonic()
        self.readers += 1
        try:
            while time.monotonic() < until:
                async with redis._bounded():
                    found: Any = await redis.client.xread(
                        {key: cursor}, count=READ_COUNT, block=block_ms
                    )
                entries: list[tuple[bytes, dict[bytes, bytes]]] = found[0][1] if found else []
                if entries:
                    chunk, done = [], False
                    for entry_id, fields in entries:
                        if _seq(entry_id) != expect:  # trimmed before it was read: cut off
                            done = True
                            break
                        if b"end" in fields:
                            done = True
                            break
                        chunk.append(fields[b"e"])
                        expect += 1
                        cursor = entry_id
                    if chunk:
                        yield b"".join(chunk)
                    if done:
                        return
                    quiet_since = time.monotonic()
                    continue
                if time.monotonic() - quiet_since < keepalive:
                    continue
                if over:  # ended, and no end marker came in a quiet interval
                    return
                stored = await self.store.get(team, response_id)
                over = stored is None or stored.status not in UNFINISHED
                quiet_since = time.monotonic()
                yield KEEPALIVE
        except (OSError, TimeoutError, errors.GatewayError) as error:
            log.info("a resumed stream of %s ended: the store failed: %s", response_id, error)
        finally:
            self.readers -= 1


def _seq(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.partition("-")[0])


def _ttl_ms(deadline: float) -> int:
    """Ms a running response's events live: to its latest end, and `KEPT_AFTER` more."""
    return max(1, int((deadline - time.time() + KEPT_AFTER) * 1000))
