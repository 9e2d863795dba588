"""One unary call (a tensor inference, an embedding) on one of a model's workers, with the
balancing, ejection and retry rules of LLM requests, less what has no meaning here.

A unary answer comes whole, so nothing of it reaches the client before it is done; which
failures are tried again on another worker is the caller's rule (`retry`), bounded like a
generation's retries, by the same loop (`retry.with_retries`). No back-off: the next try
goes to a worker not yet tried. Every try counts in its worker's calls in flight and ends
in `Worker.release`, however it ends (a cancellation says nothing of the worker), so
ejection sees unary calls as it sees generations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from gateway.fleet.retry import with_retries
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.upstreams.base import CANCELLED

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

T = TypeVar("T")


def pick(pool: ModelPool, tried: set[Worker]) -> Worker:
    """A worker for a unary call among those not yet tried, or `Unavailable`."""
    worker = pool.pick_for_unary(tried)
    if worker is None:
        raise pool.no_worker()
    return worker


def never_started(error: errors.GatewayError) -> bool:
    """The retry rule of a call that may have run on its worker: only a failure that shows
    the worker never saw it (an upstream sets the error's `never_started`)."""
    return error.never_started


async def call_unary(
    fleet: Fleet,
    pool: ModelPool,
    deadline: Deadline,
    call: Callable[[Worker], Awaitable[T]],
    retry: Callable[[errors.GatewayError], bool],
) -> tuple[T, Worker]:
    """`call` on a worker of `pool`, and that worker; a failure `retry` accepts is tried
    on another worker while attempts, time and the retry budget last (`with_retries`)."""

    async def attempt(tried: set[Worker]) -> tuple[T, Worker]:
        worker = pick(pool, tried)
        tried.add(worker)
        if pool.base is not None:  # a LoRA adapter: loaded on the worker first
            await pool.ready(worker, deadline)
        worker.outstanding += 1
        outcome: errors.GatewayError | str | None = None
        try:
            return await call(worker), worker
        except errors.GatewayError as error:
            outcome = error
            raise
        except asyncio.CancelledError:
            outcome = CANCELLED
            raise
        finally:
            worker.release(outcome)

    return await with_retries(fleet, pool, deadline, attempt, retry, backoff=0.0)
