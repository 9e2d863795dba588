"""What both ends of `GenerateMultiplexed` must agree on: the flow-control window
and how an event is counted against it, and a request's end as a status.

One call per gateway and worker carries every request's events, batched per
engine step, so grpc.aio's per-message cost (~80-130 µs on these machines) is
paid once a step, not once a request a step. A request that is not read must
not hold up the others on the call, so each has its own window, counted on both
sides by `units` on the messages they exchange, and returned by the gateway once
its client has taken what it holds.
"""

from __future__ import annotations

import grpc

from gateway.protocol import errors
from gateway.protocol.status import PARAM_KEY, error_from_status, status_from_error
from gateway.protocol.v1 import engine_pb2 as pb

#: Units (bytes, `units`) of a request's events a worker may send beyond the credit
#: returned (engine.proto).
WINDOW = 65_536
#: The gateway returns credit when its client has taken every event it holds and they
#: add up to this many units (a quarter window: a stream of short tokens returns none
#: in a typical answer).
CREDIT_STEP = WINDOW // 4

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def units(event: pb.GenerateEvent) -> int:
    """An event's size against the window: its encoded bytes, everything it carries
    counted (text, logprobs and their alternatives, a tool call's arguments). Counting
    text alone let a window of 64 Ki characters hold ~20 times that in logprobs."""
    return event.ByteSize()


#: A request that ended after its last Finished.
DONE = pb.MultiplexEnd()


def end_of(error: errors.GatewayError) -> pb.MultiplexEnd:
    """The end a worker sends for an engine's error: Generate's status, in-band."""
    code, trailing = status_from_error(error)
    param = trailing[0][1] if trailing else ""
    return pb.MultiplexEnd(code=code.value[0], message=error.message, param=param)


def end_with(code: grpc.StatusCode, message: str) -> pb.MultiplexEnd:
    """An end with a status of the worker's own (not an engine's error)."""
    return pb.MultiplexEnd(code=code.value[0], message=message)


def error_of(end: pb.MultiplexEnd) -> errors.GatewayError | None:
    """The error an end stands for (None: the request finished), through the
    same table as Generate's statuses."""
    if not end.code:
        return None
    code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
    trailing = {PARAM_KEY: end.param} if end.param else None
    return error_from_status(code, end.message, trailing)
