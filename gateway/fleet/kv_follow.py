"""Each worker's KV-cache event stream, followed into its model's `KvIndex`.

A model whose `routing:` policy reads events (`kv_aware`, `least_load`) subscribes to
every worker, over the worker's own channel (or, for a worker named in
`routing.kv_events`, to its engine's ZMQ publisher: `gateway.protocol.kv_zmq`), from
every gateway replica (each keeps its
own index; they converge because each applies the same streams, and every subscription
starts from the worker's full state). The stream's batches go into the index as they
come; when the stream ends or breaks, the worker's part of the index is dropped at once
(it is routed as holding nothing: the fallback) and the subscription is made again, with
a back-off up to `RETRY_MAX` seconds; a worker that says it publishes nothing
(UNIMPLEMENTED) is asked again every `UNSUPPORTED_RETRY` seconds, in case it is replaced
by one that does. `state` says which, per worker, for metrics and `/admin/workers`.

`upstream: openai` workers (vLLM's HTTP server) publish no load record with their events:
`follow_loads` reads one from their Prometheus `/metrics` every `routing.load_interval`
(`gateway.upstreams.openai_http.loads`; at most `LOAD_TIMEOUT` seconds a read) into the
same index, where the cost, `engine_full` and the pool's shedding read it as any other.
A server without vLLM's gauges (not a vLLM) keeps no record, logged once and shown in
`Router.scrapes` (`/admin/workers`: `routing.load_scrape`); it is read again every
`UNSUPPORTED_RETRY` seconds. A failing read drops the record (logged once a failure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gateway.fleet.data_parallel import engine_rank_of, rank_endpoint, rank_shift
from gateway.protocol import errors
from gateway.protocol.kv_blocks import EngineLoad, KvBatch
from gateway.protocol.kv_zmq import ZmqKvSubscriber

if TYPE_CHECKING:
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

log = logging.getLogger("furnace.fleet.kv")

#: Longest wait, in seconds, before subscribing again after a broken stream.
RETRY_MAX = 5.0
#: Seconds before asking again a worker that publishes no events.
UNSUPPORTED_RETRY = 60.0

#: A worker's event stream: following it, none (it publishes none), or broken.
EVENTS, UNSUPPORTED, BROKEN = "events", "unsupported", "broken"
#: A worker's `/metrics` read (`follow_loads`): a load record, none there, or failing.
LOADS = "loads"
#: Seconds a `/metrics` read may take (past `routing.load_interval` when it is short: a
#: slow read only delays the next).
LOAD_TIMEOUT = 2.0
#: A batch's sequence number for a load record alone: below any stream's, so the index
#: reads only its load, whatever events the worker's stream brings.
LOAD_ONLY = -1


@runtime_checkable
class KvEventSource(Protocol):
    """An upstream that can stream its engine's KV-cache events."""

    def kv_events(self, model: str) -> AsyncIterator[KvBatch]:
        """The batches, until the stream ends; `GatewayError` when it breaks."""
        ...


@runtime_checkable
class LoadSource(Protocol):
    """An upstream that can read its engine's load record (`upstream: openai`)."""

    async def engine_load(self, timeout: float) -> EngineLoad | None:  # noqa: ASYNC109
        """The record; None when the engine has none to give (not a vLLM)."""
        ...


class _Zmq:
    """A worker's engine that publishes over ZMQ (`routing.kv_events`), as a source."""

    def __init__(self, subscriber: ZmqKvSubscriber) -> None:
        self.subscriber = subscriber

    def kv_events(self, model: str) -> AsyncIterator[KvBatch]:
        return self.subscriber.batches()


async def follow_kv(pool: ModelPool, worker: Worker) -> None:
    """Follows the worker's events into the pool's index until the worker leaves."""
    router = pool.router
    if router is None or not router.uses_events:
        return
    index, address = router.index, worker.address
    delay = 0.1
    zmq = router.zmq.get(address)
    while not worker.leaving:
        source = worker.upstream if zmq is None else _Zmq(zmq)
        if not isinstance(source, KvEventSource):
            router.states[address] = UNSUPPORTED
            return
        if worker.serving is not True:
            await asyncio.sleep(0.05)  # health first: a worker not up yet would only refuse
            continue
        if zmq is not None:  # at its engine's rank's ports (known once it is described)
            shift = rank_shift(address, engine_rank_of(worker))
            endpoint, replay = router.zmq_endpoints[address]
            zmq.endpoint = rank_endpoint(endpoint, shift)
            zmq.replay = None if replay is None else rank_endpoint(replay, shift)
        wait = delay
        try:
            router.owners[address] = worker
            async for batch in source.kv_events(pool.name):
                # a ZMQ publisher that went away: its reset batch, then silence
                router.states[address] = EVENTS if zmq is None or zmq.connected else BROKEN
                index.apply(address, batch)
                delay = 0.1
        except errors.Invalid as error:
            router.states[address] = UNSUPPORTED
            log.info(
                "worker %s publishes no KV events (%s): routed by its load", address, error.message
            )
            wait = UNSUPPORTED_RETRY
        except errors.GatewayError as error:
            router.states[address] = BROKEN
            if not worker.leaving:
                log.warning("worker %s: KV events stopped: %s", address, error.message)
        except Exception:  # a bug must not stop the follower: log it, fall back, go on
            router.states[address] = BROKEN
            log.exception("worker %s: KV events failed", address)
        else:
            router.states[address] = BROKEN
        finally:
            if router.owners.get(address) is worker:
                index.drop(address)
        await asyncio.sleep(wait)
        delay = min(delay * 2, RETRY_MAX)
    if router.owners.get(address) is worker:
        del router.owners[address]
        router.states.pop(address, None)


async def follow_loads(pool: ModelPool, worker: Worker) -> None:
    """Reads the worker's load record into the pool's index until the worker leaves,
    for a model whose routing reads the engines' state (as `follow_kv`)."""
    router = pool.router
    source = worker.upstream
    if router is None or not router.uses_events or not isinstance(source, LoadSource):
        return
    index, address, interval = router.index, worker.address, router.config.load_interval
    while not worker.leaving:
        wait = interval
        if worker.serving is True:  # health first: a worker not up yet would only refuse
            before = router.scrapes.get(address)
            try:
                load = await source.engine_load(max(interval, LOAD_TIMEOUT))
            except errors.GatewayError as error:
                load, state = None, BROKEN
                if before != BROKEN and not worker.leaving:
                    log.warning(
                        "worker %s: no load record from /metrics: %s", address, error.message
                    )
            except Exception:  # a bug (or an answer httpx cannot decode) must not stop it
                load, state = None, BROKEN
                if before != BROKEN:
                    log.exception("worker %s: reading its load record failed", address)
            else:
                state = LOADS if load is not None else UNSUPPORTED
            if load is not None:
                index.apply(address, KvBatch(LOAD_ONLY, load=load))
            else:
                _forget_load(pool, address)
            if state == UNSUPPORTED:
                wait = UNSUPPORTED_RETRY
                if before != UNSUPPORTED:
                    log.info(
                        "worker %s has no vLLM load gauges on /metrics: routed without its "
                        "engine's load",
                        address,
                    )
            router.scrapes[address] = state
        await asyncio.sleep(wait)
    if pool.workers.get(address) in (None, worker):  # not already a new worker's
        _forget_load(pool, address)
        router.scrapes.pop(address, None)


def _forget_load(pool: ModelPool, address: str) -> None:
    """Drops the worker's load record: its whole entry when no event stream fills it."""
    assert pool.router is not None
    index = pool.router.index
    kv = index.workers.get(address)
    if kv is None:
        return
    if kv.sequence < 0 and not kv.blocks:
        index.drop(address)
    else:
        kv.load = None
