"""Admission: what a request must hold to be served, and for how long.

    slots.py     Slots: the concurrency slots every route shares (503 when full)
    queue.py     Queue: an optional bounded wait for a slot, by priority and share
    deadline.py  Deadline: the clock of one request
    requests.py  InFlight: the requests running, and the drain on shutdown
    pump.py      EventPump: one request's events, with idle timeout, keep-alive
                 ticks and cancellation when the client goes away
    metrics.py   slots and draining for /metrics

By default there is no queue: a request that finds every slot taken is refused
at once; with `queue` configured it may wait, within bounds.
Admission knows nothing of HTTP or protobuf.
"""

from gateway.admission.deadline import Deadline
from gateway.admission.pump import EventPump
from gateway.admission.queue import Queue, QueueSettings
from gateway.admission.requests import InFlight
from gateway.admission.slots import Slots

__all__ = ["Deadline", "EventPump", "InFlight", "Queue", "QueueSettings", "Slots"]
