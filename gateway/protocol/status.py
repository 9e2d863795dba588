"""The one table between gRPC status codes and our errors, read both ways.

The engine client turns a worker's status into a `GatewayError`; the worker SDK
turns an engine's `GatewayError` into a status. Both read `STATUS_TO_ERROR`, so
the two ends of the protocol cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from gateway.protocol import errors

#: Trailing metadata key naming the parameter of an INVALID_ARGUMENT.
PARAM_KEY = "furnace-param"

C = grpc.StatusCode
STATUS_TO_ERROR: dict[grpc.StatusCode, type[errors.GatewayError]] = {
    C.INVALID_ARGUMENT: errors.Invalid,
    C.FAILED_PRECONDITION: errors.Invalid,
    C.UNIMPLEMENTED: errors.Invalid,
    C.OUT_OF_RANGE: errors.TooLong,
    C.NOT_FOUND: errors.ModelNotFound,
    C.RESOURCE_EXHAUSTED: errors.Busy,
    C.UNAVAILABLE: errors.Unavailable,
    C.ABORTED: errors.Unavailable,
    C.CANCELLED: errors.Unavailable,
    C.DEADLINE_EXCEEDED: errors.Timeout,
    C.UNAUTHENTICATED: errors.AuthFailed,
    C.PERMISSION_DENIED: errors.AuthFailed,
    C.INTERNAL: errors.Failed,
    C.UNKNOWN: errors.Failed,
    C.DATA_LOSS: errors.Failed,
}

# The first status listed for an error is the one a worker sends for it.
ERROR_TO_STATUS: dict[type[errors.GatewayError], grpc.StatusCode] = {}
for _code, _error in STATUS_TO_ERROR.items():
    ERROR_TO_STATUS.setdefault(_error, _code)
ERROR_TO_STATUS[errors.NotAnLLM] = C.INVALID_ARGUMENT
ERROR_TO_STATUS[errors.Draining] = C.UNAVAILABLE
ERROR_TO_STATUS[errors.ShutDown] = C.UNAVAILABLE
ERROR_TO_STATUS[errors.RateLimited] = C.RESOURCE_EXHAUSTED


def error_from_status(
    code: grpc.StatusCode,
    details: str | None,
    trailing: grpc.aio.Metadata | Mapping[str, str] | None = None,
) -> errors.GatewayError:
    """The error a worker's status stands for; unknown codes are engine failures."""
    error_type = STATUS_TO_ERROR.get(code, errors.Failed)
    message = details or f"engine worker answered {code.name}"
    param = trailing.get(PARAM_KEY) if trailing is not None else None
    if isinstance(param, bytes):
        param = param.decode(errors="replace")
    return error_type(message, param=param or None)


def status_from_error(
    error: errors.GatewayError,
) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The status (and trailing metadata) a worker sends for an engine's error."""
    code = ERROR_TO_STATUS.get(type(error))
    if code is None:
        code = next((c for t, c in ERROR_TO_STATUS.items() if isinstance(error, t)), C.INTERNAL)
    trailing = ((PARAM_KEY, error.param),) if error.param else ()
    return code, trailing
