"""Background responses (`background: true`, OpenAI's background mode, as vLLM's server
serves it): the POST answers at once with the response object, `queued`, and the
generation runs on in a task of its own, detached from the client's connection, then
`GET /v1/responses/{id}` reads it in whatever state it is (from any replica sharing the
store) and `POST /v1/responses/{id}/cancel` stops it.

How a run goes: the route reads and checks the body as for any request (a 400, a 404
for an unknown model, a 503 while draining come at once), stores the response
`queued`, and hands the request to a task (`Exchange.detached`: the task ends it, once,
with its own record in the metrics, the access log and the usage ledger). The task
goes through the same admission (slots, the model's queue, team limits and budgets:
`queued` is the wait there), stores `in_progress` once admitted, and serves it as a
foreground request (`request_timeout`, or `stream_timeout` with `stream`); its end is
stored as a foreground answer's is (`completed`, `incomplete`), a refusal or a failure
as `failed` with its error (`{code, message}`, as a foreground stream's
`response.failed` has it). Every
change of state is a compare-and-set in the store (`ResponseStore.put_if`), so a
cancel that wins a race with the end stays `cancelled`, and the reverse.

Cancelling: the replica that runs it cancels its call at once (the client-gone path:
the slot, the worker's call and the team's charge are freed as for a client that
left). Any other replica writes `cancelled` and sets a flag in the store, which the
running replica polls every `POLL` seconds for all its runs in one round trip: chosen
over Redis pub/sub because a flag cannot be missed (a subscriber reconnecting after a
blip of Redis loses what was published meanwhile; the flag waits), needs no connection
of its own per replica, and costs one pipelined EXISTS a run a second, only while
runs exist. Cancelling a finished response is a 400, as OpenAI's (`Cannot cancel a
completed response.`); a cancelled one is answered as it is; a foreground one is a
400; an unknown one a 404.

With `stream`, the run writes its events into a log (replay.py) that the POST's
client follows while it stays, and `GET /v1/responses/{id}?stream=true&starting_after=N`
follows again from event N+1; the log opens with `response.created` of the `queued`
response, in place of the run's own (same sequence number, 0). With Redis, the log is
copied there (shared_events.py), so a replica that does not run it serves that GET too.

Bounds: at most `responses_max_background` runs per team in each gateway process (a
429 past it): a POST that costs its client nothing to leave must not start work
without end; each run is bounded in time as any request, and its kept events in bytes
(replay.py). A drain (gateway/admission/requests.py) refuses the queued, gives the
running its grace and then cancels them, each stored `failed` with the drain's error;
it waits for the runs to record that before the store closes. A replica killed
without a drain leaves its runs unfinished: each carries a deadline (`LOST_GRACE` past
the longest it may take), past which every reader sees it `failed` (store.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from prometheus_client import Gauge
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.admission import ClientGone, InFlight, RequestContext
from gateway.edge.asgi import Message, Send, send_json
from gateway.edge.errors import APIError, from_error, internal_error, invalid
from gateway.edge.openai.generation import served
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.validation import ParsedRequest
from gateway.edge.request import Exchange, Parts, client_gone
from gateway.edge.responses.conversation_store import ConversationStore, open_conversations
from gateway.edge.responses.conversations import conversation_routes
from gateway.edge.responses.encoding import ResponsesEncoder, event
from gateway.edge.responses.replay import KEPT_AFTER, LOG_BYTES, EndedLogs, EventLog
from gateway.edge.responses.routes import (
    RESPONSES,
    ResponsesRequest,
    ResponsesRoute,
    json_response,
    not_found,
    refuse_query,
    store_routes,
)
from gateway.edge.responses.shared_events import Mirror, SharedEvents
from gateway.edge.responses.store import (
    UNFINISHED,
    RedisResponses,
    ResponseStore,
    Stored,
    open_store,
)
from gateway.fleet import ModelPool
from gateway.protocol import errors
from gateway.teams import team_of
from gateway.telemetry import RequestRecord

log = logging.getLogger("furnace.responses")

#: Seconds between the polls of the store for cancels made at other replicas.
POLL = 1.0
#: Seconds past the longest a run may take before its readers see it lost.
LOST_GRACE = 60.0
#: Seconds a cancel's flag waits for the replica running it (it polls every `POLL`).
FLAG_TTL = 60.0
#: Seconds a cancel waits for the run on this replica to end (its slot free).
CANCEL_WAIT = 5.0
SSE = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def asked_background(body: Any) -> bool:
    """Whether the body asks for background mode: `background` a boolean, and only
    with `store` (as vLLM's server and OpenAI's refuse it without)."""
    if not isinstance(body, dict) or body.get("background") is None:
        return False
    value = body["background"]
    if not isinstance(value, bool):
        raise invalid("background", "Invalid type for 'background': expected a boolean.")
    if value and body.get("store") is False:
        raise invalid("background", "background can only be used when `store` is true.")
    return value


def is_background(parsed: ParsedRequest) -> bool:
    """Whether a parsed request is a background one (`parse_body` marked it)."""
    return (
        isinstance(parsed, ResponsesRequest)
        and parsed.body is not None
        and parsed.body.echo.get("background") is True
    )


@dataclass(eq=False)
class Run:
    """One background response running on this replica: `gone` is its request's
    client-gone future, done when it is cancelled."""

    team: str
    response_id: str
    created_at: int
    gone: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    #: A streamed run's events (replay.py); None for one that is not streamed.
    log: EventLog | None = None
    #: Their copy on its way to Redis (shared_events.py), with `redis_url`.
    mirror: Mirror | None = None

    def cancel(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)


class BackgroundRuns:
    """This process's background runs, by response id: the per-team bound, the gauge,
    the tasks the drain waits for, and the poll for cancels made elsewhere."""

    def __init__(
        self, store: ResponseStore, inflight: InFlight, per_team: int, gauge: Gauge
    ) -> None:
        self.store = store
        self.inflight = inflight
        self.per_team = per_team
        self.gauge = gauge
        self.runs: dict[str, Run] = {}
        self.teams: dict[str, int] = {}
        #: Ended streamed runs' events, kept a while for clients that come back.
        self.ended = EndedLogs()
        #: With Redis: streamed runs' events written there too, for other replicas.
        self.shared = (
            SharedEvents(store, inflight.detached) if isinstance(store, RedisResponses) else None
        )
        self._poller: asyncio.Task[None] | None = None

    def reserve(self, team: str, response_id: str) -> Run:
        """A new run of the team's, or a 429 past its bound."""
        if self.teams.get(team, 0) >= self.per_team:
            raise APIError(
                429,
                f"Too many background responses in progress: at most {self.per_team} "
                "at once; wait for one to end, or cancel one.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                outcome=errors.Outcome.REJECTED,
                reason="background_limit",
            )
        loop = asyncio.get_running_loop()
        run = Run(team, response_id, int(time.time()), loop.create_future())
        self.runs[response_id] = run
        self.teams[team] = self.teams.get(team, 0) + 1
        self.gauge.labels(team).inc()
        return run

    def release(self, run: Run) -> None:
        if self.runs.pop(run.response_id, None) is None:
            return
        if run.log is not None:
            run.log.end()
            self.ended.add(run.response_id, run.team, run.log)
            if run.mirror is not None:
                run.mirror.end()
        self.teams[run.team] -= 1
        if not self.teams[run.team]:
            del self.teams[run.team]
        self.gauge.labels(run.team).dec()

    def start(self, run: Run, work: Awaitable[None]) -> None:
        """Runs `work` as the run's task, which the drain waits for."""
        task = run.task = asyncio.ensure_future(work)
        self.inflight.detached.add(task)

        def done(_: asyncio.Task[None]) -> None:
            self.inflight.detached.discard(task)
            self.release(run)

        task.add_done_callback(done)
        if isinstance(self.store, RedisResponses) and self._poller is None:
            poller = self._poller = asyncio.ensure_future(self._poll())
            self.inflight.detached.add(poller)
            poller.add_done_callback(self.inflight.detached.discard)

    def log(self, team: str, response_id: str) -> EventLog | None:
        """The team's streamed run's events, running or ended a while ago, if this
        process ran it."""
        run = self.runs.get(response_id)
        if run is not None:
            return run.log if run.team == team else None
        found = self.ended.get(response_id)
        return None if found is None or found[0] != team else found[1]

    async def cancel(self, response_id: str) -> bool:
        """Cancels the run if this process runs it, and waits (a while) for its end;
        whether it ran here."""
        run = self.runs.get(response_id)
        if run is None:
            return False
        run.cancel()
        if run.task is not None:
            await asyncio.wait([run.task], timeout=CANCEL_WAIT)
        return True

    async def deleted(self, team: str, response_id: str) -> None:
        """A deleted response's run stops (its end has nowhere to go): here at once,
        elsewhere by the flag (with Redis: any response deleted sets one, short-lived)."""
        run = self.runs.get(response_id)
        if run is not None and run.team == team:
            run.cancel()
        elif run is None and isinstance(self.store, RedisResponses):
            try:
                await self.store.ask_cancel(team, response_id, FLAG_TTL)
            except errors.GatewayError as error:  # it is deleted all the same
                log.warning("response %s: its run not told: %s", response_id, error.message)

    async def _poll(self) -> None:
        """While runs exist: every `POLL` seconds, the cancels other replicas asked."""
        try:
            while self.runs:
                await asyncio.sleep(POLL)
                runs = [(run.team, run.response_id) for run in self.runs.values()]
                try:
                    asked = await self.store.cancels_asked(runs)
                except errors.GatewayError as error:
                    log.warning("background cancels not read: %s", error.message)
                    continue
                for response_id in asked:
                    run = self.runs.get(response_id)
                    if run is not None:
                        log.info("background response %s cancelled elsewhere", response_id)
                        run.cancel()
        finally:
            self._poller = None


class DetachedExchange(Exchange):
    """A background request as its task serves it: a context and record of its own,
    no connection (its answer goes nowhere: the store keeps it)."""

    __slots__ = ("parsed", "pool", "run")

    def __init__(self, ex: Exchange, parsed: ParsedRequest, pool: ModelPool, run: Run) -> None:
        record = _record(ex.record)
        ctx = RequestContext(record, ex.ctx.team)
        old = ex.ctx
        ctx.key_id, ctx.pool, ctx.request = old.key_id, old.pool, old.request
        ctx.priority, ctx.session, ctx.alias = old.priority, old.session, old.alias
        ctx.fallbacks = old.fallbacks
        ctx.gone = run.gone
        scope = {k: v for k, v in ex.scope.items() if k != "extensions"}
        log = run.log
        send = _nowhere if log is None else _into(log, run.mirror)
        super().__init__(scope, _nothing_received, send, ctx, ex.headers)
        self.parsed, self.pool, self.run = parsed, pool, run


def _record(old: RequestRecord) -> RequestRecord:
    record = RequestRecord(old.request_id)
    record.route, record.team, record.key_id = old.route, old.team, old.key_id
    record.model, record.asked, record.prompt = old.model, old.asked, old.prompt
    record.stream = old.stream
    return record


def _into(log: EventLog, mirror: Mirror | None) -> Send:
    """A streamed run's answer: into its events' log (and, with Redis, marked for the
    writer of its copy there: once a send, whatever it holds)."""

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body":
            log.feed(message.get("body", b""))
            if mirror is not None:
                mirror.changed()

    return send


async def _nothing_received() -> Message:
    await asyncio.Future()  # never: a detached request has no client to leave
    raise AssertionError


async def _nowhere(message: Message) -> None:
    """A detached request's answer: the store has it already."""


class BackgroundRoute(ResponsesRoute):
    """`POST /v1/responses`, with background mode."""

    def __init__(
        self,
        parts: Parts,
        limits: InputLimits,
        store: ResponseStore,
        conversations: ConversationStore,
    ) -> None:
        super().__init__(parts, limits, store, conversations)
        config = parts.config
        self.runs = BackgroundRuns(
            store,
            parts.inflight,
            config.responses_max_background,
            parts.telemetry.metrics.background,
        )
        #: The longest a run may wait in a queue: its deadline's share for it.
        self.max_wait = max((m.queue.max_wait for m in config.models if m.queue), default=0.0)

    async def parse_body(self, body: Any, ex: Exchange) -> ParsedRequest:
        """The body; `background` is this module's (the rest is the route's)."""
        if not asked_background(body):  # `background: false` asks nothing of the parser
            return await super().parse_body(body, ex)
        rest = {k: v for k, v in body.items() if k != "background"}
        request = await super().parse_body(rest, ex)
        assert isinstance(request, ResponsesRequest) and request.body is not None
        body_echo = {**request.body.echo, "background": True}
        return replace(request, body=replace(request.body, echo=body_echo))

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> ResponsesEncoder:
        """The route's encoder; a background response was created when it was queued."""
        encoder = super().encoder(parsed, pool)
        if is_background(parsed):
            run = self.runs.runs.get(encoder.id)
            if run is not None:
                encoder.created_at = run.created_at
        return encoder

    async def serve(self, ex: Exchange) -> None:
        if isinstance(ex, DetachedExchange):
            await self._run(ex)
            return
        parsed, pool = await self.prepare(ex)
        if not is_background(parsed):
            ex.watch_client()  # from here: a queued client that goes away leaves the queue
            async with self.admission.admit(ex.ctx):
                await self._serve(parsed, served(ex.ctx, pool), ex)
            return
        await self._detach(parsed, pool, ex)

    # -- the POST ---------------------------------------------------------------------

    async def _detach(self, parsed: ParsedRequest, pool: ModelPool, ex: Exchange) -> None:
        """Stores the response `queued`, starts its task and answers with it."""
        assert isinstance(parsed, ResponsesRequest)
        self.admission.draining(ex.ctx)  # a draining gateway takes none
        run = self.runs.reserve(parsed.team, parsed.response_id)
        assert parsed.body is not None
        shared = self.runs.shared if parsed.body.stream else None
        try:
            deadline = time.time() + self.max_wait + self._timeout(parsed) + LOST_GRACE
            queued = self._object(parsed, pool.name, run.created_at, "queued")
            stored = self._stored(parsed, queued, "", deadline)
            if shared is None:
                await self.store.put(parsed.team, stored)
            else:  # with its first event in Redis, in the same round trip
                created = event("response.created", {"sequence_number": 0, "response": queued})
                await shared.open(parsed.team, stored, created, deadline)
        except errors.GatewayError as error:
            self.runs.release(run)
            raise from_error(error, self.config.retry_after, ex.record.request_id) from None
        except BaseException:
            self.runs.release(run)
            raise
        if parsed.body.stream:
            run.log = EventLog()
            run.log.append(event("response.created", {"sequence_number": 0, "response": queued}))
            if shared is not None:
                run.mirror = shared.add(parsed.team, run.response_id, run.log, deadline)
        detached = DetachedExchange(ex, parsed, pool, run)
        ex.detached = True  # the task ends the request, and counts it
        self.runs.start(run, self._end(detached))
        request_id = (b"x-request-id", ex.record.request_id.encode("latin-1"))
        if run.log is None:
            await send_json(ex.send, 200, orjson.dumps(queued), [request_id])
            return
        # the events as they come, until the run ends or this client goes away (the
        # run goes on: it resumes with GET ...?stream=true&starting_after=N)
        gone = client_gone(ex.scope, ex.receive)
        try:
            await ex.send(
                {"type": "http.response.start", "status": 200, "headers": [*SSE, request_id]}
            )
            async for chunk in run.log.follow(-1, self.config.keepalive_interval, gone):
                await ex.send({"type": "http.response.body", "body": chunk, "more_body": True})
            await ex.send({"type": "http.response.body", "body": b""})
        finally:
            gone.cancel()

    def _timeout(self, request: ResponsesRequest) -> float:
        """The longest its answer may take, as `_serve` bounds it."""
        config = self.config
        return config.stream_timeout if request.stream else config.request_timeout

    def _object(
        self, request: ResponsesRequest, model: str, created_at: int, status: str
    ) -> dict[str, Any]:
        """The response object before any output (`queued`, `in_progress`)."""
        assert request.body is not None
        encoder = ResponsesEncoder(model, request.body, request.response_id, request)
        encoder.created_at = created_at
        return encoder._object(status)  # the encoder's own shape, with no output yet

    def _stored(
        self, request: ResponsesRequest, response: dict[str, Any], worker: str, deadline: float
    ) -> Stored:
        assert request.body is not None
        return Stored(
            response,
            list(request.body.items),
            request.history,
            request.depth,
            worker,
            request.session,
            deadline,
        )

    # -- the task ------------------------------------------------------------------------

    async def _run(self, ex: DetachedExchange) -> None:
        """Admission, `in_progress`, the answer (stored by `_store`)."""
        parsed = ex.parsed
        assert isinstance(parsed, ResponsesRequest)
        async with self.admission.admit(ex.ctx):
            pool = served(ex.ctx, ex.pool)
            deadline = time.time() + self._timeout(parsed) + LOST_GRACE
            running = self._object(parsed, pool.name, ex.run.created_at, "in_progress")
            was = await self.store.put_if(
                parsed.team, self._stored(parsed, running, "", deadline), ("queued",)
            )
            if was != "queued":  # cancelled (or deleted) while it waited
                raise ClientGone
            await self._serve(parsed, pool, ex)

    async def _end(self, ex: DetachedExchange) -> None:
        """The task: serves the request to its end, counts it, and stores how it ended
        where the answer did not (a refusal, a failure, a cancel, the drain)."""
        parsed, record = ex.parsed, ex.record
        assert isinstance(parsed, ResponsesRequest)
        try:
            try:
                refusal = await self._serve_to_the_end(ex)
            except asyncio.CancelledError:
                # the drain's last resort: the run did not end in its grace
                error = errors.ShutDown("The gateway shut down before the response ended.")
                await self._fail(ex, from_error(error, None))
                raise
            except Exception:  # the answer had begun, and the gateway failed
                log.exception("background response %s failed", parsed.response_id)
                refusal = internal_error()
            if refusal is not None:
                await self._fail(ex, refusal)
            elif ex.ctx.client_left():
                await self._settle(ex, "cancelled", None)
        finally:
            self.telemetry.finish(record)

    async def _fail(self, ex: DetachedExchange, error: APIError) -> None:
        await self._settle(
            ex, "failed", {"code": error.code or error.type, "message": error.message}
        )

    async def _settle(
        self, ex: DetachedExchange, status: str, error: dict[str, Any] | None
    ) -> None:
        """Stores the run's end, unless it has one already (a cancel's, the answer's)."""
        parsed = ex.parsed
        assert isinstance(parsed, ResponsesRequest)
        ended = self._object(parsed, served(ex.ctx, ex.pool).name, ex.run.created_at, status)
        ended["error"] = error
        events = ex.run.log
        if events is not None and error is not None and not events.ended:
            # its stream's end, as a failure mid-stream ends it
            fields = {**error, "param": None}
            events.append(event("error", {"sequence_number": events.next_seq, **fields}))
            events.append(
                event("response.failed", {"sequence_number": events.next_seq, "response": ended})
            )
        try:
            await self.store.put_if(parsed.team, self._stored(parsed, ended, "", 0.0), UNFINISHED)
        except errors.GatewayError as failure:
            log.warning(
                "background response %s: its end (%s) not stored: %s",
                parsed.response_id,
                status,
                failure.message,
            )

    async def _store(self, request: ResponsesRequest, final: dict[str, Any], worker: str) -> bool:
        """A background response's answer replaces it only while it is unfinished: a
        cancel that came first stays (and the answer is not added to its conversation)."""
        if not is_background(request):
            return await super()._store(request, final, worker)
        try:
            was = await self.store.put_if(
                request.team, self._stored(request, final, worker, 0.0), UNFINISHED
            )
        except errors.Unavailable as error:
            log.warning("response %s not stored: %s", request.response_id, error.message)
            return True
        if was not in UNFINISHED:
            log.info("response %s ended %s: its answer is not kept", request.response_id, was)
            return False
        return True


def resume_endpoint(route: BackgroundRoute) -> Callable[[Request], Awaitable[Response]]:
    """`GET /v1/responses/{id}?stream=true&starting_after=N`: a streamed background
    response's events after N (all without it), from this process's log of them, or
    with Redis from their copy there (shared_events.py)."""
    store, runs, retry_after = route.store, route.runs, route.config.retry_after
    keepalive = route.config.keepalive_interval
    # a resume from Redis follows at most as long as a run may last
    longest = route.max_wait + route.config.stream_timeout + LOST_GRACE

    async def resume(request: Request) -> Response:
        refuse_query(request, ("stream", "starting_after"))
        team = team_of(request.scope)
        name = "" if team is None else team.name
        response_id = request.path_params["response_id"]
        query = {k.removesuffix("[]"): v for k, v in request.query_params.multi_items()}
        after = -1
        if query.get("starting_after", "") != "":
            try:
                after = int(query["starting_after"])
            except ValueError:
                after = -2
            if after < 0:
                raise invalid("starting_after", "Invalid 'starting_after': an integer, 0 or more.")
        log = runs.log(name, response_id)
        if log is None:
            try:
                found = await store.get(name, response_id)
            except errors.GatewayError as error:
                raise from_error(error, retry_after) from None
            if found is None:
                raise not_found(response_id)
            if runs.shared is not None:
                return await runs.shared.resume(name, found, after, keepalive, longest, retry_after)
            raise invalid(
                "stream",
                "This response's events are not kept here: only a background response "
                "created with 'stream' keeps them, in the gateway process that runs it, "
                f"until {KEPT_AFTER:g} seconds after its end; read it without 'stream'.",
            )
        if after + 1 < log.first:
            raise invalid(
                "starting_after",
                f"The events before {log.first} are no longer kept (at most "
                f"{LOG_BYTES} bytes of a response's events are).",
            )
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        events = log.follow(after, keepalive)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    return resume


def cancel_route(route: BackgroundRoute) -> Route:
    """`POST /v1/responses/{id}/cancel`."""
    store, runs, retry_after = route.store, route.runs, route.config.retry_after

    async def cancel(request: Request) -> Response:
        team = team_of(request.scope)
        name = "" if team is None else team.name
        response_id = request.path_params["response_id"]
        try:
            found = await store.get(name, response_id)
            if found is None:
                raise not_found(response_id)
            if found.response.get("background") is not True:
                raise APIError(
                    400,
                    "Only responses created with background set to true can be cancelled.",
                    param="response_id",
                )
            if found.status == "cancelled":
                return json_response(found.response)
            _check_unfinished(found.status)
            cancelled = Stored(
                {**found.response, "status": "cancelled"},
                found.input,
                found.history,
                found.depth,
                found.worker,
                found.session,
            )
            was = await store.put_if(name, cancelled, UNFINISHED)
            if was is None:
                raise not_found(response_id)
            if was == "cancelled":
                return json_response(cancelled.response)
            _check_unfinished(was)
            if not await runs.cancel(response_id):
                await store.ask_cancel(name, response_id, FLAG_TTL)
        except errors.GatewayError as error:  # the store failed: a 503
            raise from_error(error, retry_after) from None
        return json_response(cancelled.response)

    return Route(RESPONSES + "/{response_id}/cancel", cancel, methods=["POST"])


def _check_unfinished(status: str) -> None:
    """A finished response cannot be cancelled: a 400 as OpenAI's."""
    if status in UNFINISHED:
        return
    if status in ("completed", "failed"):
        message = f"Cannot cancel a {status} response."
    else:
        message = "Cannot cancel a response in terminal state."
    raise APIError(400, message, param="response_id")


def responses_routes(parts: Parts, limits: InputLimits) -> tuple[dict[str, Any], list[Route]]:
    """The hot route (path → route), the store's routes and the conversations' routes
    (conversations.py), on one store and one of conversations: Redis's when the teams
    have one, else this process's memory."""
    config, redis = parts.config, parts.teams.limiter.redis
    store = open_store(redis, config.responses_ttl, config.responses_per_team)
    conversations = open_conversations(
        redis, config.responses_ttl, config.conversations_per_team, config.conversations_max_items
    )
    route = BackgroundRoute(parts, limits, store, conversations)
    routes = store_routes(store, config.retry_after, resume_endpoint(route), route.runs.deleted)
    more = conversation_routes(conversations, config.retry_after, config.max_body_bytes)
    return {RESPONSES: route}, [*routes, cancel_route(route), *more]
