"""Admission: what a request must pass and hold to be served, and for how long.

    admit.py       Admission: the one ordered sequence of stages every route goes
                   through (draining → visibility → saturation → team limits →
                   budgets → queue or fair share → slot) over one RequestContext,
                   and `end`, the one ending point
    slots.py       Slots: the concurrency slots every route shares (503 when full)
    queue.py       Queue: an optional bounded wait for a slot, by priority and share
    fair_share.py  FairShare: the teams' weighted shares of the slots, at the door
    bodies.py      BodyBytes: the bytes of request bodies being read, per process
                   and per team
    requests.py    InFlight: the requests running, and the drain on shutdown
    pump.py        EventPump: one request's events, with idle timeout, keep-alive
                   ticks and cancellation when the client goes away
    turns.py       WriteTurns: the loop-wide write turns that paced streams share
    metrics.py     slots and draining for /metrics

By default there is no queue: a request that finds every slot taken is refused
at once; with `queue` configured it may wait, within bounds.
Admission knows nothing of HTTP or protobuf; it sits above the teams and the
fleet, whose limits and pools its stages consult.
"""

from gateway.admission.admit import Admission, ClientGone, RequestContext
from gateway.admission.pump import EventPump
from gateway.admission.queue import Queue, QueueSettings
from gateway.admission.requests import InFlight
from gateway.admission.slots import Slots

__all__ = [
    "Admission",
    "ClientGone",
    "EventPump",
    "InFlight",
    "Queue",
    "QueueSettings",
    "RequestContext",
    "Slots",
]
