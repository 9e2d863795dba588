"""The errors every layer speaks: one tree, translated from foreign errors at one
boundary each (gRPC statuses in `status`, an upstream's HTTP in its module, HTTP
to clients in `gateway.edge.errors`).

    GatewayError                                                     outcome
    ├── Refusal        the request is refused as asked, before any work
    │   ├── Invalid        a bad parameter (carries its name)          invalid
    │   │   └── CannotCount  the model's upstream counts no tokens   invalid
    │   ├── TooLong        prompt beyond the model's context           invalid
    │   ├── ModelNotFound  no such model (here or on the worker) retry invalid
    │   ├── NotAnLLM       the model is served elsewhere               invalid
    │   ├── Busy           no slot free (the gateway's, a team's
    │   │                  share, the queue, or a worker's)      retry rejected
    │   ├── Draining       the gateway is shutting down                rejected
    │   └── RateLimited    a team's limit is reached                   rejected
    │       └── BudgetExceeded  a team's budget is spent               rejected
    ├── EngineError    the worker or its engine failed to answer
        ├── Unavailable    worker down, unreachable, or gave up  retry engine_error
        ├── Timeout        a deadline passed                           timeout
        ├── AuthFailed     the worker refused the gateway              engine_error
        └── Failed         anything else went wrong in the engine      engine_error
    └── ShutDown       the gateway's drain ran out mid-answer          shutdown

A refusal is mostly the gateway's own (its checks of the body, its slots, queue, limits,
budgets and drain); a worker's refusals of the same kinds (a parameter its engine
refuses, its own capacity, a model it does not serve) arrive as the same classes, so
one answer stands for each whoever refused. An `EngineError` is always a failure of the
worker's side (or of reaching it). `ShutDown` is neither: the gateway itself stopped
(its drain's grace ran out) while the answer was under way; counting it as an engine's
failure paged on every rollout. Code that handles any of ours catches `GatewayError`.

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
    SHUTDOWN = "shutdown"


class GatewayError(Exception):
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


class Refusal(GatewayError):
    """The request is refused as asked, before any work: by the gateway's checks, limits
    or capacity, or by a worker's of the same kinds."""

    outcome = Outcome.REJECTED


class EngineError(GatewayError):
    """The worker or its engine failed to answer (or could not be reached)."""


class Invalid(Refusal):
    """A request parameter is wrong; `param` names it when known."""

    outcome = Outcome.INVALID


class CannotCount(Invalid):
    """The model's upstream cannot count a prompt's tokens (an OpenAI-compatible server
    without `/tokenize`, an engine without a tokenizer of its own): an `Invalid` naming
    `model`, answered as one, but a class of its own so that the routes that count to
    edit a prompt (Anthropic's context editing, the Responses API's truncation) answer
    their own refusal for it without reading `param`."""

    @classmethod
    def of(cls, error: GatewayError) -> GatewayError:
        """`error`, a count's refusal, as this class where it names `model`: a worker's
        status or another server's body says it so, the class does not cross the wire."""
        if type(error) is Invalid and error.param == "model":
            return cls(error.message, param="model")
        return error


class TooLong(Refusal):
    """The prompt does not fit the model's context, or leaves no token of it for the
    answer (a `max_tokens` past what it leaves is cut to it, as vLLM does)."""

    outcome = Outcome.INVALID


class ModelNotFound(Refusal):
    """The model is not served here."""

    retryable = True
    outcome = Outcome.INVALID


class NotAnLLM(Refusal):
    """The model is listed but not served by the LLM routes."""

    outcome = Outcome.INVALID


class Busy(Refusal):
    """No capacity left; try again shortly. Its reason says whose: the gateway's
    slots (`slots_full`), a team's fair share (`fair_share`), or a worker's."""

    retryable = True
    outcome = Outcome.REJECTED
    default_reason = "worker_busy"


class Draining(Refusal):
    """The gateway is shutting down and takes no new request."""

    outcome = Outcome.REJECTED
    default_reason = "draining"


class RateLimited(Refusal):
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


class ShutDown(GatewayError):
    """The gateway shut down (its drain's grace ran out) before the answer was complete."""

    outcome = Outcome.SHUTDOWN
