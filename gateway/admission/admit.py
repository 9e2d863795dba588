"""The one ordered admission every route goes through, as named stages over one
request context (`RequestContext`) that grows as it passes, in the shape of SGLang's
gateway (`routers/grpc/pipeline.rs`): a newcomer reads the order here, once.

    the route (edge)                        the stages (this module)
    ─────────────────────────────────────   ──────────────────────────────────────────
    RequestContext(record, team)  ────────▶ before_body  the team's RPM and concurrency,
                                                         before a byte of the body is read
    reads the body (BodyMeter)    ────────▶ bodies.py    the bytes being read, bounded
    parses the body                         visibility   the model, if the team may see it
                                            ── admit(ctx): ─────────────────────────────
                                            draining     a drain refuses new requests
                                            saturation   every worker of the model full
                                            team_limits  the team's RPM, TPM, concurrency
                                            budgets      the team's spend over its
                                                         windows, reserved
                                            slot         through the model's queue, or by
                                                         the teams' fair share, or plain;
                                                         a queue's refusal: a fallback's
    serves (the fleet, the encoder)         ── the body of `async with admit(ctx)` ─────
    one ending: status and outcome known ─▶ end(ctx)     the team's usage settled, the
                                                         client-gone watch dropped

Visibility runs before saturation, not after: a team must not learn from a 503 naming
it that a model it may not see is busy. `end` is the one ending point, called by the
edge's request frame once per request however it ended (served, refused at any stage,
the client gone: 499, the gateway failed), with the record's status, outcome and token
counts final: what is owed is settled there, and only there.

Each stage is a plain method: a refusal is a `Refusal` (`Draining`, `Busy`,
`ModelNotFound`, `RateLimited`) that the edge turns into its API's shape. Cost: a few
attribute reads and one context object per request; the token path pays nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from gateway.admission.bodies import BodyBytes, BodyMeter
from gateway.admission.fair_share import FairShare
from gateway.admission.metrics import QueueCollector
from gateway.admission.queue import Queue, QueueSettings
from gateway.admission.requests import InFlight, UnaryCall
from gateway.admission.slots import low_cap
from gateway.config import AliasConfig, Config
from gateway.fleet import Fleet, ModelPool
from gateway.protocol import errors, features
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import AudioRequest, EmbedRequest, GenerateRequest, Started
from gateway.teams import Team, Teams
from gateway.teams.budgets import Reservation
from gateway.teams.limiter import Lease
from gateway.telemetry import RequestRecord, Telemetry
from gateway.upstreams.base import UpstreamCall

log = logging.getLogger("furnace.admission")

T = TypeVar("T")

#: Names the 404 of an unknown model lists at most.
LISTED = 32
#: A queue's refusals (gateway.admission.queue) after which a request goes to a fallback.
QUEUE_REFUSALS = frozenset({"queue_full", "queue_wait", "queue_timeout"})


class RequestContext:
    """One request as it passes the stages: what the edge knows at the door (`record`,
    `team`), what the route adds once the body is parsed (`request`, `priority`,
    `gone`), and what the stages fill (`pool`, `lease`, `admitted`)."""

    __slots__ = (
        "admitted",
        "alias",
        "fallbacks",
        "gone",
        "key_id",
        "lease",
        "pool",
        "priority",
        "record",
        "request",
        "reservation",
        "session",
        "team",
    )

    def __init__(self, record: RequestRecord, team: Team | None) -> None:
        #: The request's running tally: id, model, status, outcome, token counts.
        self.record = record
        #: The caller's team (its key's), or None on an open gateway.
        self.team = team
        #: The model's pool, once `visibility` found it.
        self.pool: ModelPool | None = None
        #: What the team's token limits weigh (None: one request, no tokens, as a
        #: tensor inference or a metadata read).
        self.request: GenerateRequest | EmbedRequest | AudioRequest | None = None
        #: The `x-furnace-priority` asked (the team's own caps it), or None.
        self.priority: int | None = None
        #: Done when the client goes away: the one client-gone future of the request,
        #: set by the route once the body is read; `end` drops it.
        self.gone: asyncio.Future[None] | None = None
        #: What `team_limits` charged the team, settled by `end`.
        self.lease: Lease | None = None
        #: Whether the request holds (or held) a slot.
        self.admitted = False
        #: Its key's id (`gateway.teams.accounts.key_id`), for the ledger and key budgets.
        self.key_id: str | None = None
        #: Its session key (`x-session-id`, else the body's `user`): an alias's draw.
        self.session: str | None = None
        #: The alias the request named, when it named one (`pool` is its target).
        self.alias: str | None = None
        #: Whether the route serves on the pool the stages leave in `pool` (a fallback).
        self.fallbacks = False
        #: What `budgets` reserved, settled by `end`.
        self.reservation: Reservation | None = None

    def client_left(self) -> bool:
        """Whether the client has gone away (then the request ends as a 499)."""
        return self.gone is not None and self.gone.done()


class Admission:
    """The stages over the gateway's parts; one per gateway."""

    def __init__(
        self,
        config: Config,
        inflight: InFlight,
        fleet: Fleet,
        teams: Teams,
        telemetry: Telemetry,
        registry: CollectorRegistry,
    ) -> None:
        self.inflight = inflight
        self.fleet = fleet
        self.teams = teams
        self.telemetry = telemetry
        self.accounts = teams.accounts
        self.aliases = teams.aliases  # the same object a reload of the config changes
        slots = inflight.slots
        demand_memory = max(5.0, 3.0 * config.retry_after)
        self.fair_share = FairShare(slots, teams.by_name.values(), demand_memory)
        #: Each queued model's settings; no entry: refused at once when full.
        self.queues = {
            m.name: QueueSettings(m.queue.max_wait, m.queue.max_depth, m.queue.max_starvation)
            for m in config.models
            if m.queue is not None
        }
        #: The share of the workers and slots low priorities leave to the others.
        self.headroom = config.low_priority_headroom
        self.queue = Queue(slots) if self.queues else None
        if self.queue is not None:
            registry.register(QueueCollector(self.queue))
        self.bodies = BodyBytes(
            config.max_body_bytes_in_flight,
            config.max_team_body_bytes_in_flight,
            config.retry_after,
        )

    # -- the stages, in the order they run ---------------------------------------

    def before_body(self, ctx: RequestContext) -> BodyMeter:
        """Before a byte of the body is read: the team's requests per minute and
        concurrency (a 429 that charges nothing, and counts under no model: none is read
        yet); then the meter that bounds the bytes of bodies being read (bodies.py),
        which the body's reader takes and releases."""
        if ctx.team is not None:
            self.teams.limiter.check_before_body(ctx.team)
        return self.bodies.meter(ctx.team)

    def draining(self, ctx: RequestContext) -> None:
        """Refuses (`Draining`) once the gateway is shutting down."""
        self.inflight.check_open()

    def visibility(self, ctx: RequestContext, name: str | None, kind: str = "llm") -> ModelPool:
        """The pool of the model a request names, if its team may see it (`resolve`;
        `kind` "tensor": the /v2 routes' tensor model)."""
        if kind == "tensor":
            pool = tensor_pool(self.fleet, ctx.team, name or "")
        elif name is not None and name not in self.fleet.models and self.aliases.named(name):
            pool = self._alias(ctx, name)
        else:
            pool = resolve(self.fleet, ctx.team, name)
        ctx.pool = pool
        ctx.record.model = pool.name
        return pool

    def saturation(self, ctx: RequestContext) -> None:
        """Refuses (`Busy`) when every worker of the model runs as many requests as it
        says it can: waiting in the gateway would only move the queue here."""
        pool = _pool(ctx)
        if (
            ctx.fallbacks
            and pool.name in self.aliases.falls_back
            and (pool.saturated() or not pool.available(set()))
        ):
            fallback = next(self._fallbacks(ctx, pool, ready=True), None)
            if fallback is not None:
                self._land(ctx, fallback)
                return
        if pool.saturated():
            raise errors.Busy(
                f"Every worker of `{pool.name}` runs as many requests as it says it can.",
                reason="workers_saturated",
            )
        if self.headroom and priority_of(ctx) < 0:
            self._leave_headroom(pool, queued=pool.name in self.queues)

    def _leave_headroom(self, pool: ModelPool, queued: bool) -> None:
        """Refuses a low-priority request (`Busy`, `low_priority_headroom`) when the
        model's workers are busier than `headroom` leaves, or, without a queue, the
        gateway's slots (with one, it waits for them instead: `slot`'s cap)."""
        busy, slots = pool.busy_share(), self.inflight.slots
        if (busy is not None and busy >= 1 - self.headroom) or (
            not queued and slots.in_use >= low_cap(slots.limit, self.headroom)
        ):
            raise errors.Busy(
                f"`{pool.name}` keeps {self.headroom:.0%} of its capacity for requests of "
                "priority 0 and above; try again later.",
                reason="low_priority_headroom",
            )

    async def team_limits(self, ctx: RequestContext) -> None:
        """Charges the team's requests and tokens per minute and its concurrency
        (`RateLimited`); `end` settles the charge."""
        if ctx.team is not None:
            ctx.lease = await self.teams.limiter.admit(ctx.team, ctx.request, ctx.record)

    async def budgets(self, ctx: RequestContext) -> None:
        """Reserves the most the request may cost on its team's (and key's) budgets
        over their calendar windows (`BudgetExceeded`); `end` settles it."""
        if ctx.team is not None and ctx.team.config.budgets:
            pool, record = _pool(ctx), ctx.record
            held = await self.accounts.reserve(
                ctx.team, ctx.key_id, pool.name, ctx.request, pool.max_context,
                record.granted_tokens,  # what the team's minute granted, if it bounds it
            )  # fmt: skip
            ctx.reservation = held
            if held is not None and held.granted is not None:  # its bound from here
                granted = record.granted_tokens
                record.granted_tokens = min(held.granted, granted or held.granted)

    @asynccontextmanager
    async def slot(self, ctx: RequestContext) -> AsyncIterator[None]:
        """Holds a slot for the body of an `async with`: through the model's queue if it
        has one (the team's priority, or a lower one the request asks, and its weight
        order the wait; the client leaving leaves the queue), else by the teams' fair
        share, else plain. Raises `Busy` when none can be had."""
        pool, team = _pool(ctx), ctx.team
        settings = self.queues.get(pool.name)
        if settings is not None and self.queue is not None:
            asked = priority_of(ctx)
            cap = None  # a low priority takes a slot only below the headroom
            if self.headroom and asked < 0:
                cap = low_cap(self.inflight.slots.limit, self.headroom)
            if team is None:  # no teams: the priority asked orders the wait, counted under 0
                hold = self.queue.hold(pool.name, settings, asked, gone=ctx.gone, label=0, cap=cap)
            else:
                own = team.config.priority
                hold = self.queue.hold(
                    pool.name, settings, asked, team.name, team.weight, ctx.gone, own, cap
                )
            async with hold:
                self._admitted(ctx)
                if team is None:
                    yield
                    return
                team.slots += 1
                try:
                    yield
                finally:
                    team.slots -= 1
            return
        with self.slots_of(team):
            self._admitted(ctx)
            yield

    def slots_of(self, team: Team | None) -> contextlib.AbstractContextManager[None]:
        """A slot without a queue: by fair share for a team, plain on an open gateway."""
        return self.inflight.slots.hold() if team is None else self.fair_share.hold(team)

    def _admitted(self, ctx: RequestContext) -> None:
        ctx.admitted = True
        if ctx.lease is not None:
            ctx.lease.served = True
        self.telemetry.begin(ctx.record, _pool(ctx).name)

    # -- the sequence -------------------------------------------------------------

    def admit(self, ctx: RequestContext) -> _Admitting:
        """Runs the stages after visibility, in order, and holds the slot for the body
        of the `async with`. What the team was charged is settled by `end`, not here."""
        return _Admitting(self, ctx)

    async def _enter(self, ctx: RequestContext) -> contextlib.AsyncExitStack[bool | None] | None:
        """`admit`'s stages; the slot's exit stack, or None where the slot is a plain
        one (a model without a queue: no queue refusal to fall back from), which
        `_Admitting` holds itself."""
        self.draining(ctx)
        self.saturation(ctx)
        await self.team_limits(ctx)
        await self.budgets(ctx)
        if _pool(ctx).name not in self.queues:
            return None
        stack = contextlib.AsyncExitStack()
        await self._slot_or_fallback(ctx, stack)  # nothing entered when it raises
        return stack

    async def end(self, ctx: RequestContext) -> None:
        """The one ending point of every request, however it ended: the record's
        status, outcome and token counts are final. Drops the client-gone watch and
        settles what the team was charged (a request never served is refunded)."""
        if ctx.gone is not None:
            ctx.gone.cancel()
        lease, ctx.lease = ctx.lease, None
        if lease is not None:
            await self.teams.limiter.release(lease)
        held, ctx.reservation = ctx.reservation, None
        if held is not None or ctx.admitted:  # the budgets and the ledger: what it used
            record = ctx.record
            await self.accounts.settle(ctx.team, ctx.key_id, record.model, held, record)

    # -- aliases and fallbacks ------------------------------------------------------

    def _alias(self, ctx: RequestContext, name: str) -> ModelPool:
        """The pool of the target an alias draws (for the request's session); a target
        the team may not see is as missing as the alias."""
        own, usable = _team_aliases(ctx.team)
        target = self.aliases.resolve(name, ctx.session, own, usable)
        try:
            pool = resolve(self.fleet, ctx.team, target)
        except errors.ModelNotFound:
            raise errors.ModelNotFound(
                f"The model `{name[:256]}` does not exist.", param="model"
            ) from None
        ctx.alias = ctx.record.asked = name
        return pool

    def _fallbacks(self, ctx: RequestContext, pool: ModelPool, ready: bool) -> Iterator[ModelPool]:
        """`pool`'s fallbacks the team may use, in order (with `ready`: only those with
        a worker free now)."""
        own, usable = _team_aliases(ctx.team)
        for name in self.aliases.chain(pool.name, ctx.session, own, usable):
            fallback = self.fleet.models.get(name)
            if fallback is None or fallback.kind != pool.kind or not Teams.sees(ctx.team, name):
                continue
            if not _serves(fallback, ctx.request):
                continue
            if ready and (fallback.saturated() or not fallback.available(set())):
                continue
            yield fallback

    async def _slot_or_fallback(
        self, ctx: RequestContext, stack: contextlib.AsyncExitStack[bool | None]
    ) -> None:
        """The slot stage, entered on `stack`; when the model's queue refuses (full, or
        no slot within its wait) and the route may fall back, the same stage on each of
        its fallbacks in turn, after the team's checks for it (`_move`). The first
        refusal is raised when none has a slot."""
        pool = _pool(ctx)
        try:
            await stack.enter_async_context(self.slot(ctx))
            return
        except errors.Busy as error:
            if error.reason not in QUEUE_REFUSALS or not (ctx.fallbacks and self.falls_back(ctx)):
                raise
            refused = error
        for fallback in list(self._fallbacks(ctx, pool, ready=False)):
            await self._move(ctx, fallback)
            try:
                await stack.enter_async_context(self.slot(ctx))
                return
            except errors.Busy as error:
                if error.reason not in QUEUE_REFUSALS:
                    raise
        raise refused

    async def _move(self, ctx: RequestContext, pool: ModelPool) -> None:
        """The request goes to `pool` (a fallback) once its budgets are reserved: its
        reservation moves to `pool`'s prices, in one change of its counters
        (`BudgetExceeded` when what that adds has no room), so the budgets are charged
        for the model that serves. Shielded: a client leaving meanwhile (this may run in
        a unary task) does not leave the counters and the reservation apart."""
        self._land(ctx, pool)
        if ctx.reservation is not None:
            await asyncio.shield(self.accounts.reprice(ctx.reservation, pool.name))

    @staticmethod
    def _land(ctx: RequestContext, pool: ModelPool) -> None:
        log.info(
            "request %s: served by %s instead of %s",
            ctx.record.request_id,
            pool.name,
            _pool(ctx).name,
        )
        record = ctx.record
        record.asked = record.asked or record.model
        ctx.pool = pool
        record.model = pool.name

    def falls_back(self, ctx: RequestContext) -> bool:
        """Whether the request's model has fallbacks (its start then goes by `start`)."""
        return _pool(ctx).name in self.aliases.falls_back

    async def start(
        self,
        ctx: RequestContext,
        request: GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
    ) -> tuple[Started, UpstreamCall]:
        """Starts the request on its model, or on its fallbacks (`on_fallbacks`), each as
        the fleet starts any request. Never later than the first event: that is where it
        ends. `ctx.pool` is the model that serves."""

        def call(pool: ModelPool) -> Awaitable[tuple[Started, UpstreamCall]]:
            named = request if pool.name == request.model else replace(request, model=pool.name)
            return self.fleet.start_call(pool, named, deadline, metadata, ctx.record)

        return await self.on_fallbacks(ctx, deadline, call)

    async def on_fallbacks(
        self, ctx: RequestContext, deadline: Deadline, call: Callable[[ModelPool], Awaitable[T]]
    ) -> T:
        """`call` on the request's model; when it fails before any answer (a retryable
        refusal: no worker reachable, all busy, none started in time: the fleet's retries
        spent), on its fallbacks in order, each after the team's checks for it (`_move`),
        while the deadline lasts. The first failure is raised when all fail so.
        `ctx.pool` is the model that served."""
        pool = _pool(ctx)
        try:
            return await call(pool)
        except errors.GatewayError as error:
            if not error.retryable or deadline.remaining() <= 0:
                raise
            first = error
        for fallback in self._fallbacks(ctx, pool, ready=False):
            await self._move(ctx, fallback)
            try:
                return await call(fallback)
            except errors.GatewayError as error:
                if not error.retryable or deadline.remaining() <= 0:
                    raise
        raise first

    def aliases_of(self, team: Team | None) -> list[str]:
        """The aliases `team` may use: those with a target it may use."""
        own = team.config.aliases if team is not None else ()
        return [
            name
            for name in self.aliases.names(own)
            if name not in self.fleet.models
            and any(
                t in self.fleet.models and Teams.sees(team, t)
                for t in self.aliases.targets(name, own)
            )
        ]

    # -- unary calls ----------------------------------------------------------------

    async def unary(
        self, ctx: RequestContext, work: Awaitable[T], within: float | None, what: str
    ) -> T:
        """Runs a unary worker call (one answer, whole) as a task the drain can cancel:
        it ends when the call does, the client leaves (`ClientGone`) or `within`
        seconds pass (`Timeout`, naming `what`; None: the call's own deadline)."""
        task = asyncio.ensure_future(work)
        call = UnaryCall(task)
        waits: set[asyncio.Future[Any]] = {task} if ctx.gone is None else {task, ctx.gone}
        try:
            with self.inflight.track(call):
                await asyncio.wait(waits, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if call.reason is None and not ctx.client_left() and within is not None:
                    call.reason = errors.Timeout(f"{what} took longer than {within:g} seconds.")
        if call.reason is not None:
            raise call.reason
        if task.cancelled():
            raise ClientGone
        return task.result()


class ClientGone(Exception):
    """The client went away: the request ends as a 499, nothing more written."""


def _team_aliases(
    team: Team | None,
) -> tuple[Sequence[AliasConfig], Callable[[str], bool] | None]:
    """A team's own aliases, and whether it may use a model (None: everyone may)."""
    if team is None:
        return (), None
    return team.config.aliases, lambda model: Teams.sees(team, model)


def resolve(fleet: Fleet, team: Team | None, name: str | None) -> ModelPool:
    """The LLM pool a request names (its team's first when it names none); a model the
    team may not see is as missing as an unknown one, and the 404 lists what the team
    may use instead, so a typo is fixed in one try; a tensor model is a 400 naming the
    /v2 route. A name the team may use is looked up at once; the list is made for the
    rest."""
    if name is not None and name in fleet.models and Teams.sees(team, name):
        return fleet.get(name)
    pools = usable(fleet, team)
    if name is None:
        name = next((p.name for p in pools if p.kind == "llm"), None)
        if name is None:
            raise errors.ModelNotFound("No model is named, and none is served.", param="model")
    if not any(pool.name == name for pool in pools):
        llms = [pool.name for pool in pools if pool.kind == "llm"]  # what these routes serve
        names = llms[:LISTED]
        more = ", ..." if len(llms) > LISTED else ""
        listing = f" Models you can use: {', '.join(names)}{more}." if names else ""
        raise errors.ModelNotFound(
            f"The model `{name[:256]}` does not exist.{listing}", param="model"
        )
    return fleet.get(name)


def tensor_pool(fleet: Fleet, team: Team | None, name: str) -> ModelPool:
    """The tensor model's pool (one the team may see), or a 404."""
    pool = fleet.models.get(name)
    if pool is None or pool.kind != "tensor" or not Teams.sees(team, name):
        raise errors.ModelNotFound(f"The tensor model `{name}` does not exist.")
    return pool


def usable(fleet: Fleet, team: Team | None) -> list[ModelPool]:
    """The pools `team` may use, language models first, each group in config order."""
    pools = [pool for pool in fleet.models.values() if Teams.sees(team, pool.name)]
    return sorted(pools, key=lambda pool: pool.kind != "llm")


def _serves(pool: ModelPool, request: GenerateRequest | EmbedRequest | AudioRequest | None) -> bool:
    """Whether `pool` serves what the request asks (a fallback that does not is passed
    over): a generation within its `max_tokens_limit` (one with no bound of its own, or
    a larger one, would go past it), an embeddings request with what its workers, as far
    as they described themselves, serve."""
    cap = pool.max_tokens_limit
    if isinstance(request, GenerateRequest) and cap is not None:
        bound = request.sampling.max_tokens
        return bound is not None and bound <= cap
    served = pool.features()
    if not isinstance(request, EmbedRequest) or served is None:
        return True
    asked = {features.EMBEDDINGS}
    if request.dimensions is not None:
        asked.add(features.DIMENSIONS)
    if request.user:
        asked.add(features.USER)
    return asked <= served


def priority_of(ctx: RequestContext) -> int:
    """The request's priority: the one it asks (`x-furnace-priority`), capped by its
    team's own, which is the default; on an open gateway what it asks, else 0."""
    if ctx.team is None:
        return ctx.priority or 0
    own = ctx.team.config.priority
    return own if ctx.priority is None else min(ctx.priority, own)


def _pool(ctx: RequestContext) -> ModelPool:
    pool = ctx.pool
    assert pool is not None, "visibility runs before the other stages"
    return pool


class _Admitting:
    """`Admission.admit`'s context manager: a plain object. Every request enters one;
    as an `@asynccontextmanager` around an exit stack around another, the usual
    request (a model without a queue) paid about 300 bytecodes more for them."""

    __slots__ = ("_admission", "_ctx", "_plain", "_stack")

    def __init__(self, admission: Admission, ctx: RequestContext) -> None:
        self._admission, self._ctx = admission, ctx
        self._plain: contextlib.AbstractContextManager[None] | None = None
        self._stack: contextlib.AsyncExitStack[bool | None] | None = None

    async def __aenter__(self) -> None:
        admission, ctx = self._admission, self._ctx
        self._stack = await admission._enter(ctx)
        if self._stack is None:
            plain = admission.slots_of(ctx.team)
            plain.__enter__()
            try:
                admission._admitted(ctx)
            except BaseException:
                plain.__exit__(None, None, None)
                raise
            self._plain = plain

    async def __aexit__(self, *exc: Any) -> bool | None:
        if self._plain is not None:
            self._plain.__exit__(*exc)
            return None
        assert self._stack is not None
        return await self._stack.__aexit__(*exc)
