"""Runs batches: each line of a batch's input through the gateway's own route for its
endpoint, in this process, as a request of the team that made the batch.

A line is served as any request of that team is: admission (slots, the model's queue,
the team's limits and budgets), the route's checks, a worker, the metrics, the access
log and the usage ledger, with the id `batch_req_…` as its `x-request-id`. It asks for
the priority `batch_priority` (`x-furnace-priority`; the team's own caps it), so with a
queue the batch waits behind interactive requests. At most `batch_concurrency` lines of
all of a process's batches are in flight at once. A refusal that says "later" (429 of
the team's limits or budgets, 503 of full slots, a queue or a drain) is not the line's
answer: the line is sent again after the refusal's Retry-After (or a back-off from 1 to
`MAX_BACKOFF` seconds), until the batch expires. Any other answer is recorded: a 2xx in
the output file, the rest in the error file, each as OpenAI writes them.

A batch's run ends in one of:
- `failed`: its input file failed validation (lines.py), or is gone;
- `completed`: every line recorded;
- `cancelled`: `POST /v1/batches/{id}/cancel` made it `cancelling`; the lines in flight
  are ended as a client that leaves ends them (their slots and calls freed), the rest
  never sent;
- `expired`: its 24 hours passed first; the lines not done are written to the error file
  with the error `batch_expired`, as OpenAI does.
Then its output and error files are shown (each only if it has lines) and its `usage`
added up from the output's answers.

Where a batch runs: the replica that made it, holding it by a lease in a shared store
(Redis), renewed every third of `LEASE_TTL`. A replica that drains lets its runs go (the
lines in flight end with the drain, what they answered is kept, the rest unsent) and
another replica resumes each within `ORPHAN_POLL` seconds; one killed outright, once its
lease lapses. A resumed run sends only the lines not recorded, so a line whose answer was
being written when its replica died is sent again (at least once, never recorded twice).
A cancel made at another replica is seen by the one running it at its next poll
(`POLL`). With this process's memory as the store, a batch lives and dies with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from gateway.admission import InFlight
from gateway.edge.asgi import LOST_EXTENSION, ASGIApp
from gateway.edge.batches.lines import Line, read_lines
from gateway.edge.batches.store import ENDED, UNFINISHED, BatchStore, StoredBatch, Tokens
from gateway.protocol import errors
from gateway.teams import SCOPE_KEY, Team, Teams
from gateway.telemetry.metrics import RequestMetrics

log = logging.getLogger("furnace.batches")

#: Seconds between a replica's looks at its runs (cancels made elsewhere).
POLL = 1.0
#: Seconds between looks for runs no replica holds.
ORPHAN_POLL = 5.0
#: Seconds a replica's hold on a run lasts unless renewed.
LEASE_TTL = 30.0
#: The longest wait before a line refused for "later" is sent again.
MAX_BACKOFF = 30.0
#: Statuses of a refusal that asks to come back later (not a line's answer).
LATER = frozenset({429, 503})
#: The most bytes of one line's answer kept (a larger one is the line's 500): with
#: `batch_concurrency` lines in flight, what a process may hold of their answers.
MAX_ANSWER = 16 * 1024 * 1024
EXPIRED = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}

#: A line's error when its answer would pass what the store keeps of the team's files.
NO_ROOM = {
    "code": "output_too_large",
    "message": "The answer was not kept: the team's files would pass what the gateway "
    "keeps of them in its memory. Delete some files or batches (or keep them in Redis).",
}


@dataclass(frozen=True, slots=True)
class BatchSettings:
    """The config's bounds on batches."""

    concurrency: int
    priority: int
    max_requests: int
    max_body: int


@dataclass(eq=False)
class Run:
    """One batch running here: what stops it, and its lines in flight."""

    team: str
    batch_id: str
    #: A cancel asked for it.
    cancelled: bool = False
    #: Its window passed while it ran (its expiry's timer: which may fire a little before
    #: the wall clock reads its `expires_at`, the clocks being two).
    expired: bool = False
    #: Set by a cancel or the batch's expiry: no line more is sent, those in flight end.
    halted: asyncio.Event = field(default_factory=asyncio.Event)
    #: The client-gone futures of the lines in flight (done: the line is ended).
    lines: set[asyncio.Future[None]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None

    def halt(self, cancelled: bool = False) -> None:
        """Sends no more lines and ends those in flight, as their client leaving would."""
        self.cancelled = self.cancelled or cancelled
        self.halted.set()
        self.stop()

    def expire(self) -> None:
        """Its window passed: halted, to end as `expired`."""
        self.expired = True
        self.halt()

    def stop(self) -> None:
        """Ends the lines in flight."""
        for gone in self.lines:
            if not gone.done():
                gone.set_result(None)


@dataclass(slots=True)
class Answer:
    """What a route answered one line."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    size: int = 0


def ids(prefix: str) -> str:
    """A new id of OpenAI's shape (`batch_…`, `file-…`, `batch_req_…`)."""
    return prefix + secrets.token_hex(12)


class BatchRunner:
    """This process's batch runs, on a store shared or not."""

    def __init__(
        self,
        store: BatchStore,
        teams: Teams,
        inflight: InFlight,
        settings: BatchSettings,
        metrics: RequestMetrics,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.teams = teams
        self.inflight = inflight
        self.settings = settings
        #: The endpoints' routes (path → ASGI app, before the edge's checks), once served.
        self.routes: Mapping[str, ASGIApp] = {}
        #: This replica, as the holder of its runs' leases.
        self.owner = secrets.token_hex(8)
        self.runs: dict[tuple[str, str], Run] = {}
        self._lines = asyncio.Semaphore(settings.concurrency)
        self._keeper: asyncio.Task[None] | None = None
        self.lines_sent = 0

    # The lifecycle.

    def start(self) -> None:
        """Starts the keeper: cancels from other replicas, leases, runs to resume."""
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        """Stops the keeper and every run (after a drain: their lines have ended), letting
        each go for another replica to resume."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        tasks = [run.task for run in self.runs.values() if run.task is not None]
        for run in self.runs.values():
            run.stop()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _keep(self) -> None:
        last_orphans = last_renew = 0.0
        while True:
            await asyncio.sleep(POLL)
            now = time.monotonic()
            try:
                # a cancel at another replica (one at this replica halts its run at once)
                for run in list(self.runs.values()) if self.store.shared else ():
                    stored = await self.store.batch(run.team, run.batch_id)
                    if stored is None or stored.status in ("cancelling", *ENDED):
                        run.halt(cancelled=True)
                if now - last_renew >= LEASE_TTL / 3:
                    last_renew = now
                    held = list(self.runs)
                    await self.store.renew(held, self.owner, LEASE_TTL)
                # a draining replica keeps its leases (its lines end with the drain) and
                # takes no new runs
                if now - last_orphans >= ORPHAN_POLL and not self.inflight.draining:
                    last_orphans = now
                    for team, batch_id in await self.store.orphans(self.owner):
                        await self.begin(team, batch_id)
            except errors.GatewayError as error:  # the store is down: try again next poll
                log.warning("batches: the store failed: %s", error)
            except Exception:  # the keeper must outlive any surprise, or runs stop
                log.exception("batches: the keeper failed")

    # Runs.

    async def begin(self, team: str, batch_id: str) -> None:
        """Runs the batch here, unless it runs here already or another replica holds it."""
        if (team, batch_id) in self.runs or self.inflight.draining:
            return
        if not await self.store.claim(team, batch_id, self.owner, LEASE_TTL):
            return
        run = self.runs[(team, batch_id)] = Run(team, batch_id)
        self.metrics.batches_running.labels(team).inc()
        run.task = asyncio.get_running_loop().create_task(self._run(run))

    def cancel(self, team: str, batch_id: str) -> None:
        """Cancels a run of this replica's at once (others see it at their next poll)."""
        run = self.runs.get((team, batch_id))
        if run is not None:
            run.halt(cancelled=True)

    async def _run(self, run: Run) -> None:
        ended = False
        try:
            ended = await self._serve(run)
        except asyncio.CancelledError:
            pass
        except errors.GatewayError as error:  # the store failed: another poll resumes it
            log.warning("batch %s: the store failed: %s", run.batch_id, error)
        except Exception:  # a fault of ours: the batch fails, rather than resuming for ever
            log.exception("batch %s: its run failed", run.batch_id)
            ended = await self._failed_by_fault(run)
        finally:
            self.runs.pop((run.team, run.batch_id), None)
            self.metrics.batches_running.labels(run.team).dec()
            with contextlib.suppress(errors.GatewayError, asyncio.CancelledError):
                await self.store.release(run.team, run.batch_id, self.owner, ended)

    async def _serve(self, run: Run) -> bool:
        """The batch served to its end, or as far as this replica may (False: to be resumed)."""
        store, team = self.store, run.team
        stored = await store.batch(team, run.batch_id)
        if stored is None or stored.status in ENDED:
            return True
        if await self._team_gone(run, stored):
            return True
        lines = await self._lines_of(run, stored)
        if lines is None:
            return True
        stored = await store.batch(team, run.batch_id) or stored
        expires, passes = float(stored.batch["expires_at"]), 0
        while stored.status == "in_progress" and not self._stopping(run, expires):
            done = (await store.progress(team, stored)).done
            todo = [line for line in lines if line.index not in done]
            if not todo:
                break
            if passes:  # lines a pass left unrecorded (the store failed): a while, then again
                await self._pause(run, MAX_BACKOFF, expires)
                if await self._team_gone(run, stored):
                    return True
            passes += 1
            await self._send_all(run, stored, todo, expires)
        if self.inflight.draining:
            return False
        stored = await store.batch(team, run.batch_id) or stored
        if stored.status == "cancelling" or run.cancelled:
            await self._end(run, stored, "cancelled", ("cancelling", "in_progress"))
        elif run.expired or time.time() >= float(stored.batch["expires_at"]):
            done = (await store.progress(team, stored)).done
            for line in lines:
                if line.index not in done:
                    out, _ = _line_out(line, None, "", EXPIRED)
                    await store.record(team, stored, line.index, out, False, {})
                    self.metrics.batch_lines.labels(team, "expired").inc()
                    stored.expired += 1
            await self._end(run, stored, "expired", ("in_progress",))
        else:
            await self._end(run, stored, "completed", ("in_progress",))
        return True

    async def _lines_of(self, run: Run, stored: StoredBatch) -> list[Line] | None:
        """The batch's requests; a batch still validating is validated (failed, or set
        in progress); None: it failed."""
        settings, file_id = self.settings, stored.batch["input_file_id"]
        content = b"".join(await self.store.content(run.team, file_id))
        if not content:  # deleted, or expired (its `expires_after`), before the run ended
            failed = {**stored.batch, "status": "failed", "failed_at": int(time.time())}
            message = f"The batch's input file {file_id} is gone (deleted or expired)."
            failed["errors"] = {"object": "list", "data": [_error("input_file_missing", message)]}
            await self._fail(run, stored, failed, ("validating", "in_progress"))
            return None
        lines, found = read_lines(
            content,
            stored.batch["endpoint"],
            settings.max_requests,
            settings.max_body,
            bodies=stored.api == "openai",
        )
        if stored.status != "validating":
            return lines
        if found:
            failed = {**stored.batch, "status": "failed", "failed_at": int(time.time())}
            failed["errors"] = {"object": "list", "data": found}
            if await self._fail(run, stored, failed, ("validating",)):
                return None
            return lines  # cancelled meanwhile: ended as such
        started = {**stored.batch, "status": "in_progress", "in_progress_at": int(time.time())}
        started["model"] = lines[0].body.get("model")
        started["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        await self.store.update(run.team, _with(stored, started), ("validating",))
        return lines

    async def _send_all(
        self, run: Run, stored: StoredBatch, lines: list[Line], expires: float
    ) -> None:
        team = self._team(run.team)
        pending: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(max(0.0, expires - time.time()), run.expire)
        try:
            for line in lines:
                if not await self._place(run):
                    break
                if self._stopping(run, expires):
                    self._lines.release()
                    break
                task = loop.create_task(self._send(run, stored, team, line, expires))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.wait(pending)
        finally:
            expiry.cancel()
            run.stop()
            for task in pending:
                task.cancel()

    async def _place(self, run: Run) -> bool:
        """A place for one more line among the process's `batch_concurrency` (released
        by `_send`), or False when the run halts first."""
        taken = asyncio.ensure_future(self._lines.acquire())
        halted = asyncio.ensure_future(run.halted.wait())
        closing = False
        try:
            await asyncio.wait((taken, halted), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the run's task cancelled (a close)
            closing = True
        halted.cancel()
        if not taken.done():
            taken.cancel()
        await asyncio.gather(taken, halted, return_exceptions=True)
        took = not taken.cancelled()
        if took and (closing or run.halted.is_set()):
            self._lines.release()
            took = False
        if closing:
            raise asyncio.CancelledError
        return took

    @staticmethod
    async def _pause(run: Run, seconds: float, expires: float) -> None:
        """Waits `seconds` (at most `MAX_BACKOFF`, never past the expiry), or until the
        run halts."""
        wait = min(seconds, MAX_BACKOFF, max(0.0, expires - time.time()))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await run.halted.wait()

    def _stopping(self, run: Run, expires: float) -> bool:
        return run.halted.is_set() or self.inflight.draining or time.time() >= expires

    async def _send(
        self,
        run: Run,
        stored: StoredBatch,
        team: Team | None,
        line: Line,
        expires: float,
    ) -> None:
        """One line sent until it has an answer to record (or its batch stops)."""
        try:
            backoff = 1.0
            body = orjson.dumps(line.body)
            while True:
                request_id = ids("batch_req_")
                answer = await self._call(run, stored.batch["endpoint"], team, body, request_id)
                if answer.status == 0 or (self._stopping(run, expires) and answer.status in LATER):
                    # ended by a cancel, a drain or the expiry: not the line's answer
                    self.metrics.batch_lines.labels(run.team, "ended").inc()
                    return
                if answer.status not in LATER:
                    break
                self.metrics.batch_lines.labels(run.team, "retried").inc()
                wait = _retry_after(answer.headers) or backoff * (0.5 + random.random())
                backoff = min(MAX_BACKOFF, backoff * 2)
                await self._pause(run, wait, expires)
                if self._stopping(run, expires):
                    return
            ok = 200 <= answer.status < 300
            out, tokens = _line_out(line, answer, request_id, None)
            if not self.store.room(run.team, len(out)):  # the memory store's bound
                ok, (out, _) = False, _line_out(line, None, request_id, NO_ROOM)
            tokens = tokens if ok else {}  # usage: the output's answers'
            try:
                await self.store.record(run.team, stored, line.index, out, ok, tokens)
            except errors.GatewayError as error:  # left for the run's next pass
                log.warning("batch %s: a line's answer not recorded: %s", run.batch_id, error)
                return
            self.metrics.batch_lines.labels(run.team, "completed" if ok else "failed").inc()
        finally:
            self._lines.release()

    async def _call(
        self, run: Run, path: str, team: Team | None, body: bytes, request_id: str
    ) -> Answer:
        """The line through the route, as a request of `team`; its answer (status 0: it
        was ended before it answered)."""
        answer = Answer()
        if run.halted.is_set():  # halted after the line was placed, before it began
            return answer  # (`halt` ends only the lines it finds in flight)
        route = self.routes[path]
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        run.lines.add(gone)
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = list(message.get("headers", ()))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                answer.size += len(chunk)
                if answer.size <= MAX_ANSWER:
                    answer.body.append(chunk)

        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"x-request-id", request_id.encode()),
                (b"x-furnace-priority", str(self.settings.priority).encode()),
            ],
            "client": None,
            "server": None,
            "extensions": {LOST_EXTENSION: gone},
            SCOPE_KEY: team,
        }
        self.lines_sent += 1
        try:
            await route(scope, receive, send)
        finally:
            run.lines.discard(gone)
            if not gone.done():
                gone.set_result(None)
        if answer.size > MAX_ANSWER:
            log.warning("batch %s: an answer of %d bytes not kept", run.batch_id, answer.size)
            return _too_large()
        return answer

    def _team(self, name: str) -> Team | None:
        """The team that made the batch, as it is now (its limits, its models)."""
        return self.teams.by_name.get(name) if name else None

    async def _team_gone(self, run: Run, stored: StoredBatch) -> bool:
        """Whether the batch's team is no longer configured (a restart without it): the
        batch failed then, its lines never sent as no team's."""
        if not run.team or run.team in self.teams.by_name:
            return False
        failed = {**stored.batch, "status": "failed", "failed_at": int(time.time())}
        message = f"The team {run.team} is no longer served by this gateway."
        failed["errors"] = {"object": "list", "data": [_error("team_not_found", message)]}
        await self._fail(run, stored, failed, ("validating", "in_progress"))
        return True

    async def _failed_by_fault(self, run: Run) -> bool:
        """The batch failed by a fault of the gateway's (logged); whether that was kept."""
        try:
            stored = await self.store.batch(run.team, run.batch_id)
            if stored is None:
                return True
            failed = {**stored.batch, "status": "failed", "failed_at": int(time.time())}
            message = "The gateway failed to run this batch; create it again."
            failed["errors"] = {"object": "list", "data": [_error("server_error", message)]}
            return await self._fail(run, stored, failed, UNFINISHED)
        except errors.GatewayError:
            return False

    async def _fail(
        self, run: Run, stored: StoredBatch, failed: dict[str, Any], states: tuple[str, ...]
    ) -> bool:
        """The batch `failed` from one of `states` (False: it was in none, and stays)."""
        if await self.store.update(run.team, _with(stored, failed), states) not in states:
            return False
        self.metrics.batches_ended.labels(run.team, "failed").inc()
        return True

    async def _end(
        self, run: Run, stored: StoredBatch, status: str, states: tuple[str, ...]
    ) -> None:
        """The batch ended as `status`: finalizing (its files shown, its usage added
        up; a cancelled one stays `cancelling` meanwhile, as OpenAI's do), then `status`."""
        store, team, now = self.store, run.team, int(time.time())
        progress = await store.progress(team, stored)
        between = "cancelling" if status == "cancelled" else "finalizing"
        batch = {**stored.batch, "status": between}
        if between == "finalizing":
            batch["finalizing_at"] = now
        if await store.update(team, _with(stored, batch), states) not in states:
            return  # cancelled or ended meanwhile, elsewhere
        files = [("output", stored.output, progress.completed)]
        files.append(("error", stored.errors, progress.failed))
        if stored.api != "openai":  # a Message Batch's results are read by its own route
            files = []
        for kind, file_id, lines in files:
            if not lines:
                continue
            if kind == "output":
                batch["usage"] = _usage(progress.sums)
            size = progress.sums.get(f"{kind}_bytes", 0)
            # kept `output_expires_after` from now, else as long as the batch
            ttl = stored.output_ttl
            expires = now + ttl if ttl else int(stored.batch["created_at"] + store.ttl)
            file = _file_object(file_id, size, f"batch_{kind}.jsonl", now, expires)
            await store.show(team, file, stored.output_ttl)
            batch[f"{kind}_file_id"] = file_id
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        if await store.update(team, _with(stored, batch), (between,)) == between:
            self.metrics.batches_ended.labels(team, status).inc()


def _with(stored: StoredBatch, batch: dict[str, Any]) -> StoredBatch:
    return replace(stored, batch=batch)


def _file_object(file_id: str, size: int, name: str, now: int, expires: int) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": now,
        "expires_at": expires,
        "filename": name,
        "purpose": "batch_output",
        "status": "processed",
        "status_details": None,
    }


def _error(code: str, message: str) -> dict[str, Any]:
    """An error of the batch's `errors` that names no line."""
    return {"code": code, "message": message, "param": None, "line": None}


def _retry_after(headers: list[tuple[bytes, bytes]]) -> float | None:
    for name, value in headers:
        if name.lower() == b"retry-after":
            with contextlib.suppress(ValueError):
                return max(0.0, float(value))
    return None


def _too_large() -> Answer:
    """The answer recorded for a line whose answer was too large to keep."""
    message = f"The answer was larger than {MAX_ANSWER} bytes, the most a batch keeps."
    error = {"message": message, "type": "server_error", "param": None, "code": None}
    body = orjson.dumps({"error": error})
    return Answer(500, [], [body], len(body))


def _line_out(
    line: Line, answer: Answer | None, request_id: str, error: dict[str, str] | None
) -> tuple[bytes, Tokens]:
    """One line of an output or error file, OpenAI's shape, and its answer's usage."""
    response, tokens = None, {}
    if answer is not None:
        raw = b"".join(answer.body)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        response = {"status_code": answer.status, "request_id": request_id, "body": body}
        tokens = _tokens(body)
    out = {
        "id": ids("batch_req_"),
        "custom_id": line.custom_id,
        "response": response,
        "error": error,
    }
    return orjson.dumps(out) + b"\n", tokens


def _tokens(body: Any) -> Tokens:
    """An answer's usage as its batch adds it up: chat's and completions' prompt and
    completion tokens, the Responses API's input and output tokens (SUMS' names)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return {}
    inputs = _count(usage, "input_tokens", "prompt_tokens")
    outputs = _count(usage, "output_tokens", "completion_tokens")
    inputs_in = usage.get("input_tokens_details") or usage.get("prompt_tokens_details")
    outputs_in = usage.get("output_tokens_details") or usage.get("completion_tokens_details")
    return {
        "input_tokens": inputs,
        "output_tokens": outputs,
        "total_tokens": _count(usage, "total_tokens") or inputs + outputs,
        "cached_tokens": _count(inputs_in, "cached_tokens"),
        "reasoning_tokens": _count(outputs_in, "reasoning_tokens"),
    }


def _count(usage: Any, *names: str) -> int:
    """The first of `names` that `usage` counts (0: none, or not a count)."""
    if isinstance(usage, dict):
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0


def _usage(sums: Tokens) -> dict[str, Any]:
    """A batch's `usage`, OpenAI's shape, from its sums."""
    return {
        "input_tokens": sums.get("input_tokens", 0),
        "output_tokens": sums.get("output_tokens", 0),
        "total_tokens": sums.get("total_tokens", 0),
        "input_tokens_details": {"cached_tokens": sums.get("cached_tokens", 0)},
        "output_tokens_details": {"reasoning_tokens": sums.get("reasoning_tokens", 0)},
    }
