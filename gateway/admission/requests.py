"""The requests in flight, so a shutdown can drain them: refuse new ones, give
those running a grace period, then cancel the rest (their workers see it).

What is registered is anything with a `cancel(reason)`: the edge's event pumps, and
`UnaryCall`, a unary call's task; so admission knows nothing of how a request is relayed.
`detached` holds the tasks that outlive their client's request (the Responses API's
background responses): the drain waits for them last, so each records how it ended
before the lifecycle closes the store it writes to, and cancels any still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from gateway.admission.slots import Slots
from gateway.protocol import errors

log = logging.getLogger("furnace.drain")

#: Seconds the cancelled requests get to write their last bytes.
CANCEL_GRACE = 5.0


class Cancellable(Protocol):
    """A running request: cancelling it stops its worker's call."""

    def cancel(self, reason: errors.GatewayError | None = None) -> None: ...


class UnaryCall:
    """A unary worker call in flight, as the drain sees it: cancelled with a reason."""

    __slots__ = ("reason", "task")

    def __init__(self, task: asyncio.Future[Any]) -> None:
        self.task = task
        self.reason: errors.GatewayError | None = None

    def cancel(self, reason: errors.GatewayError | None = None) -> None:
        self.reason = reason or errors.Unavailable("The request was cancelled.")
        self.task.cancel()


class InFlight:
    """The gateway's slots and the requests holding them, open or draining."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        #: SIGTERM came: new requests are refused while those in flight finish.
        self.draining = False
        self.running: set[Cancellable] = set()
        #: Tasks serving requests whose clients do not wait for them (see above).
        self.detached: set[asyncio.Task[Any]] = set()

    def check_open(self) -> None:
        """Raises `Draining` once the gateway is shutting down."""
        if self.draining:
            raise errors.Draining("The gateway is shutting down; send the request again.")

    def track(self, request: Cancellable) -> _Tracked:
        """Registers a running request for the body of a `with`."""
        return _Tracked(self.running, request)

    async def drain(self, grace: float) -> None:
        """Shuts the door and empties the room: new requests are refused; those
        in flight get `grace` seconds to finish; the rest are cancelled and end
        with an error."""
        self.draining = True
        if self.slots.queue is not None:
            waiting = self.slots.queue.waiting()
            if waiting:
                log.info("refusing %d queued requests", waiting)
            self.slots.queue.refuse_all(
                errors.Draining("The gateway is shutting down; send the request again.")
            )
        log.info("draining %d requests for up to %gs", self.slots.in_use, grace)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.slots.wait_idle()
        if self.running:
            log.warning("cancelling %d requests still in flight", len(self.running))
            reason = errors.ShutDown(
                "The gateway shut down before the answer was complete; send the request again."
            )
            for request in list(self.running):
                request.cancel(reason)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CANCEL_GRACE):
                await self.slots.wait_idle()
        if self.detached:
            # their calls are over (or cancelled above): what is left is recording
            # how each ended; one still going past the grace is cancelled, and records
            # that instead
            await asyncio.wait(list(self.detached), timeout=CANCEL_GRACE)
            for task in list(self.detached):
                task.cancel()
            if self.detached:
                await asyncio.wait(list(self.detached), timeout=CANCEL_GRACE)


class _Tracked:
    """`InFlight.track`'s context manager: a plain object, not a `@contextmanager`
    generator (every request enters one; a generator's frame and wrapper cost it
    about a hundred bytecodes more)."""

    __slots__ = ("_request", "_running")

    def __init__(self, running: set[Cancellable], request: Cancellable) -> None:
        self._running, self._request = running, request

    def __enter__(self) -> None:
        self._running.add(self._request)

    def __exit__(self, *exc: object) -> None:
        self._running.discard(self._request)
