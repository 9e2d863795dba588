"""The errors every layer speaks: one base, translated from foreign errors at one
boundary each (gRPC statuses in `status`, an upstream's HTTP in its module, HTTP
to clients in `gateway.edge.errors`).

    EngineError                                                      outcome
    ├── Invalid        a bad parameter (carries its name)             invalid
    ├── TooLong        prompt beyond the model's context               invalid
    ├── ModelNotFound  no such model (here or on the worker)   retry   invalid
    ├── NotAnLLM       the model is served elsewhere                   invalid
    ├── Busy           no slot free (at the edge or the worker) retry  rejected
    ├── Draining       the gateway is shutting down                    rejected
    ├── RateLimited    a team's limit is reached                       rejected
    ├── Unavailable    worker down, unreachable, or gave up    retry   engine_error
    ├── Timeout        a deadline passed                               timeout
    ├── AuthFailed     the worker refused the gateway                  engine_error
    └── Failed         anything else went wrong in the engine          engine_error

"Retry" means another worker may answer, and only before the first event.
Each class says the `outcome` it counts as (the `outcome` label of the request
metrics); a refusal also carries its `reason` (the `reason` label of the
rejection metric), so nothing above re-derives either from an HTTP status.
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    """How a request ended, the `outcome` label of the request metrics."""

    COMPLETED = "completed"
    CLIENT_GONE = "client_gone"
    TIMEOUT = "timeout"
    ENGINE_ERROR = "engine_error"
    REJECTED = "rejected"
    INVALID = "invalid"


class EngineError(Exception):
    """Base of our errors; `message` is safe to show to the API's user."""

    retryable = False
    outcome = Outcome.ENGINE_ERROR
    #: Why a request was refused before it reached a worker (rejections only).
    default_reason = ""

    def __init__(self, message: str, *, param: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.reason = reason or self.default_reason
        #: The worker never saw the call (it was not connected when the call failed), so
        #: a unary call may be tried on another worker (`fleet.unary.never_started`).
        self.never_started = False


class Invalid(EngineError):
    """A request parameter is wrong; `param` names it when known."""

    outcome = Outcome.INVALID


class TooLong(EngineError):
    """The prompt (plus max_tokens) does not fit the model's context."""

    outcome = Outcome.INVALID


class ModelNotFound(EngineError):
    """The model is not served here."""

    retryable = True
    outcome = Outcome.INVALID


class NotAnLLM(EngineError):
    """The model is listed but not served by the LLM routes."""

    outcome = Outcome.INVALID


class Busy(EngineError):
    """No capacity left; try again shortly. Its reason says whose: the gateway's
    slots (`slots_full`), a team's fair share (`fair_share`), or a worker's."""

    retryable = True
    outcome = Outcome.REJECTED
    default_reason = "worker_busy"


class Draining(EngineError):
    """The gateway is shutting down and takes no new request."""

    outcome = Outcome.REJECTED
    default_reason = "draining"


class RateLimited(EngineError):
    """A team's limit is reached; `retry_after` seconds until it has room."""

    outcome = Outcome.REJECTED

    def __init__(self, message: str, *, retry_after: int, reason: str) -> None:
        super().__init__(message, reason=reason)
        self.retry_after = retry_after


class BudgetExceeded(RateLimited):
    """A team's (or key's) budget over a calendar window is spent; `retry_after`
    seconds until the window resets."""


class Unavailable(EngineError):
    """The worker cannot be reached or dropped the request."""

    retryable = True


class Timeout(EngineError):
    """A deadline passed before the answer was complete."""

    outcome = Outcome.TIMEOUT


class AuthFailed(EngineError):
    """The worker refused the gateway's credentials."""


class Failed(EngineError):
    """The engine failed in a way the client cannot fix."""
