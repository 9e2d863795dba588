"""What the routes of one gateway share: its config, slots, fleet, and the
requests in flight (so a drain can wait for them, then cancel the rest)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from gateway import errors
from gateway.admission import Slots
from gateway.config import Config
from gateway.event_pump import EventPump
from gateway.fleet import Fleet
from gateway.openai.input_limits import InputLimits
from gateway.teams import Teams
from gateway.telemetry import Telemetry
from gateway.tracing import Tracing

log = logging.getLogger("furnace.drain")


@dataclass(eq=False)
class GatewayState:
    """The gateway's shared state; the fleet is set by the app's lifespan."""

    config: Config
    slots: Slots
    fleet: Fleet | None = None
    #: Ready for traffic: started, and not draining.
    ready: bool = False
    #: SIGTERM came: new requests are refused while those in flight finish.
    draining: bool = False
    started_at: int = 0
    inflight: set[EventPump] = field(default_factory=set)
    telemetry: Telemetry = field(init=False)
    tracing: Tracing = field(init=False)
    #: API keys, team limits and fair share (open, with plain slots, when no keys).
    teams: Teams = field(init=False)
    input_limits: InputLimits = field(init=False)

    def __post_init__(self) -> None:
        self.telemetry = Telemetry(self)
        self.tracing = Tracing(self.config.tracing)
        self.teams = Teams(self.config, self.slots, self.telemetry.registry)
        self.input_limits = InputLimits(self.config)

    async def drain(self, grace: float) -> None:
        """Shuts the door and empties the room: /ready turns false and new
        requests are refused; those in flight get `grace` seconds to finish;
        the rest are cancelled (their workers see it) and end with an error."""
        self.ready = False
        self.draining = True
        log.info("draining %d requests for up to %gs", self.slots.in_use, grace)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self.slots.wait_idle()
        if self.inflight:
            log.warning("cancelling %d requests still in flight", len(self.inflight))
            reason = errors.Unavailable("The gateway shut down before the answer was complete.")
            for pump in list(self.inflight):
                pump.cancel(reason)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):  # the cancelled ones write their last bytes
                await self.slots.wait_idle()
