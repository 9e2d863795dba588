"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
and the one table from our engine errors to HTTP.

A failure on the server's side (a worker or upstream unavailable, refusing the
gateway, failing, or too slow) reaches the client as a fixed message of its row:
what a worker or an upstream says may hold internal addresses, even passwords,
so it goes to the log (with the request id), never to the client. A refusal of
the client's own input keeps its message, bounded to MAX_MESSAGE characters.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import orjson

from gateway.protocol import errors

log = logging.getLogger("furnace.edge")

INVALID = "invalid_request_error"
SERVER = "server_error"

#: The longest message of a refusal a client sees; longer ones are cut.
MAX_MESSAGE = 512

#: Our error → HTTP status, OpenAI `type`, OpenAI `code` (DESIGN.md's table).
ERROR_TABLE: dict[type[errors.GatewayError], tuple[int, str, str | None]] = {
    errors.CannotCount: (400, INVALID, None),  # an `Invalid`, answered as one
    errors.Invalid: (400, INVALID, None),
    errors.TooLong: (400, INVALID, "context_length_exceeded"),
    errors.ModelNotFound: (404, INVALID, "model_not_found"),
    errors.NotAnLLM: (400, INVALID, "model_not_supported"),
    errors.Busy: (503, SERVER, "server_busy"),
    errors.Draining: (503, SERVER, "engine_unavailable"),
    errors.BudgetExceeded: (429, "rate_limit_error", "budget_exceeded"),
    errors.RateLimited: (429, "rate_limit_error", "rate_limit_exceeded"),
    errors.Unavailable: (503, SERVER, "engine_unavailable"),
    errors.Timeout: (504, SERVER, "timeout"),
    errors.AuthFailed: (502, SERVER, "engine_auth_failed"),
    errors.Failed: (500, SERVER, "engine_error"),
    errors.ShutDown: (503, SERVER, "gateway_shutdown"),
}

#: The fixed message the client sees for a server-side failure; the original is logged.
PUBLIC_MESSAGES: dict[type[errors.GatewayError], str] = {
    errors.Unavailable: "The model's engine is unavailable; try again later.",
    errors.Timeout: "The model's engine did not answer in time.",
    errors.AuthFailed: "The gateway could not authenticate to the model's engine.",
    errors.Failed: "The model's engine failed to serve the request.",
}
_FAILED = PUBLIC_MESSAGES[errors.Failed]


def public_message(error: errors.GatewayError) -> str:
    """What the client may read of `error`: a fixed message for a failure on the
    server's side (and anything not in the table), else its own, bounded."""
    for kind, message in PUBLIC_MESSAGES.items():
        if isinstance(error, kind):
            return message
    if not any(isinstance(error, kind) for kind in ERROR_TABLE):
        return _FAILED
    if len(error.message) > MAX_MESSAGE:
        return error.message[: MAX_MESSAGE - 3] + "..."
    return error.message


def is_hidden(error: errors.GatewayError) -> bool:
    """Whether the client sees a fixed message instead of `error`'s own."""
    return public_message(error) != error.message


class APIError(Exception):
    """An error response the edge sends as is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        outcome: errors.Outcome = errors.Outcome.INVALID,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        #: What the request counts as in the metrics, and why it was refused.
        self.outcome = outcome
        self.reason = reason
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def fields(self) -> dict[str, str | None]:
        """The inside of `{"error": ...}`."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def body(self) -> bytes:
        """The JSON body OpenAI's clients parse."""
        return orjson.dumps({"error": self.fields()})

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers: Retry-After on a 503; on a 409 (a conflict of state,
        such as cancelling an ended batch) `x-should-retry: false`, which OpenAI's and
        Anthropic's SDKs read before retrying a 409 as they otherwise do."""
        if self.status == 409:
            return [(b"x-should-retry", b"false")]
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(self.retry_after).encode())]


def request_timeout(what: str, seconds: float) -> APIError:
    """The 408 of a request whose `what` ("headers", "body") did not come in time."""
    return APIError(
        408,
        f"The request's {what} did not arrive within {seconds:g} seconds.",
        code="request_timeout",
        reason="request_timeout",
    )


def invalid(param: str | None, message: str) -> APIError:
    """A 400 naming the parameter at fault."""
    return APIError(400, message, param=param)


def unknown_parameters(body: Mapping[str, Any], fields: Collection[str]) -> None:
    """A 400 (`unknown_parameter`) naming the first field of `body` not in `fields`: a
    route that takes a few fields says so of any other, as OpenAI's do."""
    for name in body:
        if name not in fields:
            shown = str(name)[:64]
            raise APIError(
                400, f"Unknown parameter: '{shown}'.", param=shown, code="unknown_parameter"
            )


def from_error(
    error: errors.GatewayError, retry_after: int | None, request_id: str | None = None
) -> APIError:
    """The HTTP error our error stands for; what the client does not see of it is
    logged (with `request_id`, where there is one)."""
    status, type_, code = next(
        (row for kind, row in ERROR_TABLE.items() if isinstance(error, kind)),
        (500, SERVER, "engine_error"),
    )
    if isinstance(error, errors.RateLimited):
        retry_after = error.retry_after
    elif status != 503:
        retry_after = None
    message = public_message(error)
    if message != error.message:
        log.warning("request %s: %s: %s", request_id or "-", type(error).__name__, error.message)
    return APIError(
        status,
        message,
        type=type_,
        param=error.param,
        code=code,
        retry_after=retry_after,
        outcome=error.outcome,
        reason=error.reason,
    )


def internal_error() -> APIError:
    """What a client sees when the gateway itself fails."""
    return APIError(
        500,
        "The gateway failed to serve the request.",
        type=SERVER,
        code="internal_error",
        outcome=errors.Outcome.ENGINE_ERROR,
    )
