"""The errors every layer speaks: one base, translated from foreign errors at one
boundary each (gRPC statuses in `status_codes`, HTTP at the edge).

    EngineError
    ├── Invalid        a bad parameter (carries its name)        not retryable
    ├── TooLong        prompt beyond the model's context          not retryable
    ├── ModelNotFound  no such model (here or on the worker)      retryable
    ├── NotAnLLM       the model is served elsewhere              not retryable
    ├── Busy           no slot free (at the edge or the worker)   retryable
    ├── Unavailable    worker down, unreachable, or gave up       retryable
    ├── Timeout        a deadline passed                          not retryable
    ├── AuthFailed     the worker refused the gateway             not retryable
    └── Failed         anything else went wrong in the engine     not retryable

"Retryable" means another worker may answer, and only before the first event.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of our errors; `message` is safe to show to the API's user."""

    retryable = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class Invalid(EngineError):
    """A request parameter is wrong; `param` names it when known."""


class TooLong(EngineError):
    """The prompt (plus max_tokens) does not fit the model's context."""


class ModelNotFound(EngineError):
    """The model is not served here."""

    retryable = True


class NotAnLLM(EngineError):
    """The model is listed but not served by the LLM routes."""


class Busy(EngineError):
    """No capacity left; try again shortly."""

    retryable = True


class Unavailable(EngineError):
    """The worker cannot be reached or dropped the request."""

    retryable = True


class Timeout(EngineError):
    """A deadline passed before the answer was complete."""


class AuthFailed(EngineError):
    """The worker refused the gateway's credentials."""


class Failed(EngineError):
    """The engine failed in a way the client cannot fix."""
