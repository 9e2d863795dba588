"""Per-team limits at admission: requests per minute, tokens per minute and
concurrent requests, held in this gateway's memory or, with `redis_url`, in
Redis for every replica together.

Tokens are counted twice over a request's life. At admission the request
reserves all it may cost, as OpenAI does: its prompt, estimated (a quarter of
its characters; `estimate_tokens`), plus its `max_tokens` (the model's
`max_tokens_limit` when the request leaves it out: the edge sets it), and that
must fit in what is left of the minute. A request with no bound at all (no
`max_tokens`, a model with no cap: the worker's default is the context left,
as vLLM's) reserves all that is left of the minute once its prompt fits, and
that reservation goes to the worker as its `max_tokens` (`RequestRecord.
granted_tokens`; else one answer of 50,000 tokens overran a 2,000-a-minute
team 25 times), so unbounded requests of a team run one at a time rather than
each overrunning the limit. While it runs, a tick every `TICK` seconds charges
what it has really used past its reservation: the worker's prompt count once known, and
the completion tokens written so far. The end settles the rest and refunds
what it reserved and did not use (a request the worker refused gives it all
back). The token path itself pays nothing.

Local buckets mirror Redis: every answer from Redis sets them to the shared
usage. If Redis fails (a timeout, a refused connection), this gateway goes on
with the local buckets, which start from the last shared usage it saw, logs it,
and shows `furnace_gateway_limits_store_up 0`; a probe every second brings it
back to Redis once Redis answers.

A call to Redis that times out may still run when a stalled Redis resumes. An
admission that timed out (or a release that failed) leaves its lease's member
"uncertain": the next probes that find Redis up remove it from the team's
leases (ZREM, twice, so an admit script that runs late is undone too). Leases
are short-lived besides (`redis_lease_ttl`, 10 s, renewed every third of it while
the request runs), but a phantom lease is a team held back that long: the same
bound as a replica killed with requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gateway.config import Config
from gateway.protocol.errors import RateLimited
from gateway.protocol.types import AudioRequest, EmbedRequest, GenerateRequest, Message
from gateway.teams.team import Team
from gateway.telemetry.record import RequestRecord

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.limits")

#: Seconds between charges of the tokens of requests in flight.
TICK = 0.5
#: Seconds between checks that Redis answers.
PROBE_INTERVAL = 1.0
#: Renewals of the Redis leases of requests in flight in a lease's life
#: (`redis_lease_ttl`): one missed (a Redis call that timed out) loses none.
RENEWALS = 3
#: Successful probes that remove an uncertain lease member (see above).
UNCERTAIN_SWEEPS = 2
#: How the store fails: `StoreDown` is a ConnectionError, so an OSError.
STORE_FAILURES = (OSError, TimeoutError)
_LIMIT_NAMES = {
    "requests": "requests per minute",
    "tokens": "tokens per minute",
    "concurrency": "concurrent requests",
}


def estimate_tokens(request: GenerateRequest | EmbedRequest | AudioRequest | None) -> int:
    """A prompt's tokens before the worker counts them: ~4 characters a token
    (an embedding's token ids count as they are; a transcription's audio, whose tokens
    only its server knows, one: it needs room for at least that; no request, as a
    tensor call: none)."""
    if request is None:
        return 0
    if isinstance(request, AudioRequest):
        return 1
    if isinstance(request, EmbedRequest):
        if request.chat is not None:  # each conversation as a chat's messages
            return sum(map(_messages_tokens, request.chat.conversations))
        return sum(math.ceil(len(x) / 4) if isinstance(x, str) else len(x) for x in request.inputs)
    if request.messages is None:
        return math.ceil(len(request.prompt or "") / 4)
    return _messages_tokens(request.messages)


def _messages_tokens(messages: tuple[Message, ...]) -> int:
    """A conversation's tokens: ~4 characters a token, and one a message."""
    return math.ceil(sum(len(m.content) for m in messages) / 4) + len(messages)


class Lease:
    """One admitted request: what it was charged, and what it must give back."""

    __slots__ = (
        "charged",
        "counted",
        "estimate",
        "member",
        "record",
        "reserve",
        "served",
        "team",
    )

    def __init__(
        self, team: Team, estimate: int, reserve: int | None, record: RequestRecord, member: str
    ) -> None:
        self.team = team
        self.estimate = estimate
        #: Completion tokens reserved: `max_tokens`, or None (no bound) until
        #: admission sets it to what was left of the minute.
        self.reserve = reserve
        self.record = record
        self.member = member
        self.charged = 0  # tokens charged to the bucket so far (the reservation, or more)
        self.counted = estimate  # tokens counted as used so far (`Team.tokens_charged`)
        #: It took a slot; if not (the gateway was busy), its request is refunded.
        self.served = False

    @property
    def cost(self) -> int:
        """What admission must fit: the prompt and the reserved completion."""
        return self.estimate + (self.reserve or 0)

    def usage(self, final: bool) -> int:
        """Tokens the request has used: the prompt (estimated until the worker
        counts it) and the completion written so far."""
        record = self.record
        if final:  # a request the worker never started used nothing
            return record.prompt_tokens + record.tokens_sent
        return (record.prompt_tokens or self.estimate) + record.tokens_sent

    def used(self, final: bool) -> int:
        """Tokens to have charged to the bucket: while it runs, its reservation,
        or its usage once past it; at the end, its usage alone."""
        return self.usage(final) if final else max(self.cost, self.usage(final))


class Limiter:
    """Admits and settles requests against their team's limits."""

    def __init__(self, config: Config, teams: Iterable[Team]) -> None:
        self.config = config
        self.teams = list(teams)
        self.redis: RedisStore | None = None
        if config.redis_url is not None:
            from gateway.teams.redis_store import RedisStore

            self.redis = RedisStore(
                config.redis_url,
                config.redis_timeout,
                config.redis_key_prefix,
                config.redis_lease_ttl,
            )
        #: Whether Redis answered last time (None: not asked yet).
        self.redis_up: bool | None = None
        self.leases: set[Lease] = set()
        #: Lease members Redis may hold unbeknown (a call timed out): member →
        #: (team, sweeps left).
        self.uncertain: dict[str, tuple[Team, int]] = {}
        self._releasing = 0
        self._gateway = secrets.token_hex(6)  # names this gateway's leases
        self._count = 0
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Checks Redis (if any) once, and starts the tick."""
        if self.redis is not None:
            await self._probe()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stops the tick and closes Redis."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()

    async def _run(self) -> None:
        probed = renewed = time.monotonic()
        renew_interval = self.config.redis_lease_ttl / RENEWALS
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            try:
                await self._settle_running()
                if self.redis is not None and now - probed >= PROBE_INTERVAL:
                    probed = now
                    await self._probe()
                if now - renewed >= renew_interval:
                    renewed = now
                    await self._renew()
            except Exception:  # the tick must outlive any surprise
                log.exception("the limits tick failed")

    # -- Redis health -----------------------------------------------------------

    def _redis_failed(self, error: BaseException) -> None:
        if self.redis_up is not False:
            log.warning(
                "limits store (Redis) failed (%s: %s): serving with this gateway's local limits",
                type(error).__name__,
                error,
            )
        self.redis_up = False

    async def _probe(self) -> None:
        assert self.redis is not None
        try:
            await self.redis.ping()
        except STORE_FAILURES as error:
            self._redis_failed(error)
            return
        if not self.redis_up:
            log.info("limits store (Redis) answers: limits are shared by every replica")
            # the local mirrors counted the outage here; Redis (perhaps restarted empty)
            # is the count again, and the next admission reads it: until then the check
            # before a body must not refuse on the stale mirror
            now = time.monotonic()
            for team in self.teams:
                for bucket in (team.requests, team.tokens):
                    if bucket is not None:
                        bucket.set(0.0, now)
        self.redis_up = True
        if self.uncertain:
            await self._sweep_uncertain()

    def _maybe_held(self, lease: Lease) -> None:
        """A call about `lease` failed: Redis may hold (or come to hold) its member."""
        if lease.team.config.max_concurrent_requests:
            self.uncertain[lease.member] = (lease.team, UNCERTAIN_SWEEPS)

    async def _sweep_uncertain(self) -> None:
        assert self.redis is not None
        members = dict(self.uncertain)
        try:
            await self.redis.release_many((team, member) for member, (team, _) in members.items())
        except STORE_FAILURES as error:
            self._redis_failed(error)
            return
        for member, (team, left) in members.items():
            if left > 1:
                self.uncertain[member] = (team, left - 1)
            else:
                self.uncertain.pop(member, None)

    def _shared(self) -> RedisStore | None:
        return self.redis if self.redis_up else None

    async def _renew(self) -> None:
        store = self._shared()
        held = [
            (lease.team, lease.member)
            for lease in self.leases
            if lease.team.config.max_concurrent_requests
        ]
        if store is None or not held:
            return
        try:
            await store.renew(held)
        except STORE_FAILURES as error:
            self._redis_failed(error)

    # -- requests ---------------------------------------------------------------

    async def admit(
        self,
        team: Team,
        request: GenerateRequest | EmbedRequest | AudioRequest | None,
        record: RequestRecord,
    ) -> Lease:
        """Charges one request, its estimated prompt and its reserved completion
        (`max_tokens` for each of its n choices; an embedding has none, nor a call with
        no `request`, as a tensor inference) to `team`, or raises a 429."""
        estimate = estimate_tokens(request)
        reserve: int | None = 0
        if team.tokens is not None and isinstance(request, GenerateRequest):
            max_tokens = request.sampling.max_tokens
            reserve = None if max_tokens is None else max_tokens * request.n  # n choices
        self._count += 1
        lease = Lease(team, estimate, reserve, record, f"{self._gateway}:{self._count}")
        refused = await self._admit_shared(lease)
        if refused is None:
            refused = self._admit_local(lease)
        if refused:
            team.refused[refused] += 1
            raise self._too_many(team, refused, lease.cost)
        team.inflight += 1
        if reserve is None and lease.reserve is not None and isinstance(request, GenerateRequest):
            # no bound asked: what was reserved becomes its bound, so that the worker
            # cannot write past it (the route passes it on as max_tokens)
            record.granted_tokens = max(1, lease.reserve // request.n)
        lease.charged = lease.cost
        team.tokens_charged += estimate
        self.leases.add(lease)
        return lease

    async def _admit_shared(self, lease: Lease) -> str | None:
        """Redis's verdict ('' admitted, or the limit), or None to decide locally."""
        store = self._shared()
        if store is None:
            return None
        team = lease.team
        try:
            answer = await store.admit(team, lease.estimate, lease.reserve, lease.member)
        except STORE_FAILURES as error:
            self._maybe_held(lease)  # it may run yet, once Redis resumes
            self._redis_failed(error)
            return None
        if not answer.refused:
            lease.reserve = answer.reserved
        now = time.monotonic()
        if team.requests is not None:
            team.requests.set(answer.requests_used, now)
        if team.tokens is not None:
            team.tokens.set(answer.tokens_used, now)
        return answer.refused

    def _admit_local(self, lease: Lease) -> str:
        team, now = lease.team, time.monotonic()
        if team.requests is not None and team.requests.wait(1, now):
            return "requests"
        if team.tokens is not None and team.tokens.wait(lease.cost, now):
            return "tokens"
        limit = team.config.max_concurrent_requests
        if limit is not None and team.inflight >= limit:
            return "concurrency"
        if team.requests is not None:
            team.requests.charge(1, now)
        if team.tokens is not None:
            if lease.reserve is None:  # no bound: all that is left of the minute
                left = team.tokens.limit - team.tokens.level(now) - lease.estimate
                lease.reserve = max(0, math.floor(left))
            team.tokens.charge(lease.cost, now)
        return ""

    def check_before_body(self, team: Team) -> None:
        """Refuses (429), before its body is read, a request its team could not be
        admitted for by count alone: its requests per minute spent, or as many requests
        in flight as it may have. Charges nothing: `admit` does, once the body is read.
        The local view (mirroring the shared store's last answer, with Redis) decides;
        it never counts more than the store, so it refuses nothing `admit` would take."""
        now = time.monotonic()
        refused = ""
        limit = team.config.max_concurrent_requests
        if team.requests is not None and team.requests.wait(1, now):
            refused = "requests"
        elif limit is not None and team.inflight >= limit:
            refused = "concurrency"
        if refused:
            team.refused[refused] += 1
            raise self._too_many(team, refused, 1)

    def _too_many(self, team: Team, refused: str, cost: int) -> RateLimited:
        config, now = team.config, time.monotonic()
        if refused == "requests" and team.requests is not None:
            limit, wait = config.requests_per_minute, math.ceil(team.requests.wait(1, now))
        elif refused == "tokens" and team.tokens is not None:
            limit, wait = config.tokens_per_minute, math.ceil(team.tokens.wait(cost, now))
        else:  # concurrency: a slot of its own comes back when a request ends
            limit, wait = config.max_concurrent_requests, self.config.retry_after
        wait = max(wait, 1)
        return RateLimited(
            f"Rate limit reached for team `{team.name}` on {_LIMIT_NAMES[refused]} "
            f"(limit {limit}). Please try again in {wait}s.",
            retry_after=wait,
            reason=f"team_{refused}",
        )

    @property
    def idle(self) -> bool:
        """No request admitted and not yet settled."""
        return not self.leases and not self._releasing

    async def release(self, lease: Lease) -> None:
        """Settles the request's tokens, ends its lease, and refunds the request
        itself if it never got a slot. (The answer's last byte is already out,
        so a client's next request may come a moment before this is done.)"""
        self.leases.discard(lease)  # out of the tick's sight before any wait
        self._releasing += 1
        team = lease.team
        team.inflight -= 1
        try:
            await self._settle(lease, final=True)
            if not lease.served and team.requests is not None:
                await self._charge(team, "requests", -1)
            store = self._shared()
            if self.redis is not None and team.config.max_concurrent_requests:
                if store is None:  # Redis may hold it: gone once Redis answers
                    self._maybe_held(lease)
                else:
                    await store.release(team, lease.member)
        except STORE_FAILURES as error:
            self._maybe_held(lease)
            self._redis_failed(error)
        finally:
            self._releasing -= 1

    @staticmethod
    def _take_delta(lease: Lease, final: bool) -> int:
        """Tokens `lease` owes its bucket since its last charge (negative: a
        refund), marked charged at once (so a tick and the end, each waiting on
        Redis, never charge them both). Counts its usage meanwhile."""
        usage = lease.usage(final)
        lease.team.tokens_charged += usage - lease.counted
        lease.counted = usage
        delta = lease.used(final) - lease.charged
        lease.charged += delta
        return delta

    async def _settle(self, lease: Lease, final: bool) -> None:
        delta = self._take_delta(lease, final)
        if delta and lease.team.tokens is not None:
            await self._charge(lease.team, "tokens", delta)

    async def _settle_running(self) -> None:
        """One charge per team for the tokens its requests in flight used lately."""
        deltas: dict[Team, int] = {}
        for lease in self.leases:
            delta = self._take_delta(lease, final=False)
            if delta and lease.team.tokens is not None:
                deltas[lease.team] = deltas.get(lease.team, 0) + delta
        for team, delta in deltas.items():
            if delta:
                await self._charge(team, "tokens", delta)

    async def _charge(self, team: Team, what: str, amount: float) -> None:
        bucket = team.requests if what == "requests" else team.tokens
        assert bucket is not None
        store = self._shared()
        if store is not None:
            try:
                used = await store.charge(team, what, bucket.limit, amount)
            except STORE_FAILURES as error:
                self._redis_failed(error)
            else:
                bucket.set(used, time.monotonic())
                return
        bucket.charge(amount, time.monotonic())
