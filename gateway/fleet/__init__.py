"""The fleet: models, the workers that serve each, and which worker takes a request.

    Fleet
    ├── ModelPool (one per model)   pool.py        workers, balancer
    │   └── Worker                  worker.py      in flight, health, ejection
    ├── AdapterPool (a LoRA adapter) adapters.py   its base's workers, the adapter loaded
    ├── discovery                   discovery.py   host:port and dns: entries
    ├── data-parallel engines       data_parallel.py  each engine of a server a worker
    ├── fit                         fit.py         a worker kept out for what it says it is
    ├── balancing                   balancing.py   power of two choices, prefix affinity
    └── RetryBudget                 retry.py       retries as a fraction of requests, and
                                                   the one retry loop (`with_retries`)
    aliases.py       aliases, weighted splits and fallbacks: which model serves a request
    embedding.py     an embedding, on that rule
    inference.py     a tensor inference and a model's metadata, on that rule
    kv_follow.py     a worker's KV events followed into the index, and an `openai`
                     worker's load record read from its /metrics
    kv_index.py      which worker holds which KV-cache blocks, from the engines' events
    metrics.py       retries, and each worker's calls, health and ejections, for /metrics
    routing.py       routing on what the engines hold and have queued
    unary.py         one unary call on a model's workers, with their retry rule
    counting.py      a prompt's tokens counted or shown, ids decoded, on one of the model's workers
    audio.py         speech written down (or translated) on one of the model's workers
    prefill.py       a prompt prefilled on a prefill worker, its KV cache for the decode
                     worker (`prefill_workers`: prefill/decode disaggregation)

A request goes to a worker its model's balancer picks among the available ones
(serving, not ejected, not leaving). A retryable refusal before the worker's
first event (busy, unreachable, not started in time) is tried again on another
worker, with jittered back-off, while attempts, time and the retry budget last.
After the first event nothing is retried: the client may hold part of the answer.
Background tasks keep membership (DNS) and health (the gRPC health service) fresh,
and follow rotations of `worker_tls`'s files: new credentials, new channels for
new calls, the old channels closed once their calls end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import replace
from functools import partial
from typing import Any, cast

import httpx

from gateway.config import Config, ModelConfig
from gateway.fleet.adapters import AdapterPool
from gateway.fleet.data_parallel import engine_rank_of, split
from gateway.fleet.discovery import Target, resolve
from gateway.fleet.fit import idle_engines, misfit
from gateway.fleet.kv_follow import follow_kv, follow_loads
from gateway.fleet.pool import ModelPool
from gateway.fleet.prefill import prefilled
from gateway.fleet.retry import RetryBudget, with_retries
from gateway.fleet.worker import Worker
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.tls import FilesStamp, WorkerCredentials, client_credentials, files_stamp
from gateway.protocol.types import GenerateRequest, Started
from gateway.telemetry import RequestRecord
from gateway.upstreams.base import Upstream, UpstreamCall
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.upstreams.kserve_grpc import KServeGrpcUpstream
from gateway.upstreams.openai_http import OpenAIHttpUpstream, http_client
from gateway.upstreams.openai_http.polls import SharedPolls
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from gateway.upstreams.vllm_kv import RankedEvents

__all__ = ["Fleet", "ModelPool", "Worker"]

log = logging.getLogger("furnace.fleet")

DESCRIBE_TIMEOUT = 2.0
#: How often the `worker_tls` files are checked for a rotation (at most).
TLS_CHECK_INTERVAL = 5.0


def _retryable(error: errors.GatewayError) -> bool:
    return error.retryable


class _StartTimeout:
    """`asyncio.timeout(delay)` as a plain `with`, for the start of every call: the same
    cancellation of the task when `delay` passes, turned into `TimeoutError` on the way
    out (unless the task was cancelled meanwhile for another reason), without its state
    machine, rescheduling and coroutine frames (~145 bytecodes a request)."""

    __slots__ = ("_cancelling", "_expired", "_task", "_timer")

    def __init__(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("Timeout should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        self._timer: asyncio.Handle = (
            loop.call_at(loop.time() + delay, self._expire)
            if delay > 0
            else loop.call_soon(self._expire)
        )

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> None:
        self._timer.cancel()
        if (
            self._expired
            and self._task.uncancel() <= self._cancelling
            and kind is asyncio.CancelledError
        ):
            raise TimeoutError from error

    def _expire(self) -> None:
        self._expired = True
        self._task.cancel()


class Fleet:
    """Every model of the config; create and start it on the serving loop."""

    def __init__(self, config: Config) -> None:
        self.config = config
        #: Pooled HTTP clients for `openai` upstreams, by `ca_file` (None: the system's roots).
        self._http: dict[str | None, httpx.AsyncClient] = {}
        self.models: dict[str, ModelPool] = {
            m.name: ModelPool(m, config, self._upstream_factory(m))
            for m in config.models
            if m.adapter_of is None
        }
        for m in config.models:  # LoRA adapters: pools of their base's workers
            if m.adapter_of is not None:
                self.models[m.name] = AdapterPool(m, config, self.models[m.adapter_of])
        #: The pools with workers of their own (not adapters), prefill workers' included:
        #: what discovery, health, TLS and closing go over.
        self.own = [pool for pool in self.models.values() if pool.base is None]
        for m in config.models:  # prefill workers: a pool of their own, beside the model's
            if m.prefill_workers:
                # picked by the model's `balance`, or by `prefill_routing` (else `routing`) on
                # their own KV events and loads: where a prompt's prefix is cached counts most
                routing = m.prefill_routing or m.routing
                prefill = replace(m, workers=m.prefill_workers, weights=(), routing=routing)
                pool = self.models[m.name].prefill = ModelPool(
                    prefill, config, self._upstream_factory(prefill), prefill_tier=True
                )
                self.own.append(pool)
        self.budget = RetryBudget(config.retry_budget)
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ----------------------------------------------------------

    def _upstream_factory(self, model: ModelConfig) -> Callable[[str], Upstream]:
        """How the model's workers are reached: our gRPC protocol, vLLM's, or HTTP; a
        data-parallel server's engine (`ADDRESS#dpR`) on an upstream pinned to its rank."""
        if model.data_parallel_size == 1:
            return self._server_factory(model)
        make = cast(Callable[..., Upstream], self._server_factory(model))
        # the engines of one server share what is the server's (held by their upstreams:
        # gone with the server's last one): a vLLM gRPC server's KV-event stream, each
        # reading its rank's; an OpenAI server's polls
        kind: type[RankedEvents | SharedPolls] = RankedEvents
        keyword = "ranked_events"
        if model.upstream == "openai":
            kind, keyword = SharedPolls, "polls"
        shared: weakref.WeakValueDictionary[str, RankedEvents | SharedPolls]
        shared = weakref.WeakValueDictionary()

        def engine(address: str) -> Upstream:
            server, rank = split(address)
            held = shared.get(server)
            if held is None:
                held = shared[server] = kind()
            return make(server, data_parallel_rank=rank, **{keyword: held})

        return engine

    def _server_factory(self, model: ModelConfig) -> Callable[[str], Upstream]:
        if model.upstream == "vllm-grpc":
            assert model.tokenizer is not None  # the config requires it
            return partial(
                VllmGrpcUpstream,
                model=model.name,
                tokenizer=model.tokenizer,
                tool_call_parser=model.tool_call_parser,
                reasoning_parser=model.reasoning_parser,
                plain_text_contents=model.plain_text_contents,
                credentials=self._credentials(),
            )
        if model.upstream == "kserve-grpc":
            return partial(KServeGrpcUpstream, model=model.name, credentials=self._credentials())
        if model.upstream != "openai":
            return partial(
                FurnaceGrpcUpstream,
                credentials=self._credentials(),
                multiplex=self.config.multiplex_workers,
            )

        api_key = os.environ[model.api_key_env] if model.api_key_env is not None else None

        def upstream(
            base_url: str, data_parallel_rank: int | None = None, polls: SharedPolls | None = None
        ) -> Upstream:
            client = self._http_client(model.ca_file)
            return OpenAIHttpUpstream(base_url, client, api_key, data_parallel_rank, polls=polls)

        return upstream

    def _http_client(self, ca_file: str | None) -> httpx.AsyncClient:
        """One pool for every upstream that trusts the same CA, made on the loop."""
        client = self._http.get(ca_file)
        if client is None:
            verify: ssl.SSLContext | bool = True
            if ca_file is not None:
                verify = ssl.create_default_context(cafile=ca_file)
            client = self._http[ca_file] = http_client(verify)
        return client

    def _tls_stamp(self) -> FilesStamp:
        tls = self.config.worker_tls
        return () if tls is None else files_stamp(tls.ca_file, tls.cert_file, tls.key_file)

    def _credentials(self) -> WorkerCredentials | None:
        tls = self.config.worker_tls
        if tls is None:
            return None
        return client_credentials(tls.ca_file, tls.cert_file, tls.key_file, tls.server_name)

    async def _follow_tls(self) -> None:
        """Checks the `worker_tls` files; when they change, every gRPC worker gets
        a channel with the new credentials (calls in flight end on the old one)."""
        stamp = self._tls_stamp()
        interval = min(self.config.health_check_interval, TLS_CHECK_INTERVAL)
        while True:
            await asyncio.sleep(interval)
            for pool in self.own:
                for worker in pool.idle_leavers():
                    self._spawn(worker.upstream.close())
            if self._tls_stamp() == stamp:
                continue
            try:
                self._credentials()  # readable, before any channel changes
            except OSError as error:
                log.warning("worker TLS: cannot read the rotated files yet: %s", error)
                continue
            stamp = self._tls_stamp()
            log.info("worker TLS: files changed; new channels to the workers use them")
            for model in self.config.models:
                if model.upstream != "openai":  # gRPC channels carry the credentials
                    pool = self.models[model.name]
                    for own in (pool, pool.prefill):  # its prefill workers' channels too
                        if own is not None:
                            for worker in own.replace_upstreams(self._upstream_factory(model)):
                                self._spawn(self._watch(own, worker))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def background_tasks(self) -> int:
        """Tasks watching membership and health; 0 once closed."""
        return len(self._tasks)

    async def start(self, wait: float = 2.0) -> None:
        """Resolves every entry, starts watching workers, and waits up to `wait`
        seconds for each to report its health once."""
        for pool in self.own:
            for target in pool.targets:
                await self._discover(pool, target)
                if target.is_dns:
                    self._spawn(self._rediscover(pool, target))
        if self.config.worker_tls is not None:
            self._spawn(self._follow_tls())
        end = time.monotonic() + wait
        workers = [w for pool in self.own for w in pool.workers.values()]
        # a short wait at start, for /ready to mean "the workers answered"
        while time.monotonic() < end and any(w.serving is None for w in workers):  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Stops the background tasks and closes every channel."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pool in self.models.values():
            if isinstance(pool, AdapterPool):
                await pool.cancel_loads()
        await asyncio.gather(
            *(w.upstream.close() for pool in self.own for w in pool.workers.values()),
            *(w.upstream.close() for pool in self.own for w in pool.retired),
        )
        for client in self._http.values():
            await client.aclose()

    async def _discover(self, pool: ModelPool, target: Target) -> None:
        try:
            addresses = await resolve(target)
        except OSError as error:
            log.warning("model %s: cannot resolve %s: %s", pool.name, target.entry, error)
            return
        pool.update(target, addresses, lambda w: self._spawn(self._watch(pool, w)))
        for worker in pool.idle_leavers():
            log.info("model %s: worker %s closed", pool.name, worker.address)
            self._spawn(worker.upstream.close())

    async def _rediscover(self, pool: ModelPool, target: Target) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval)
            await self._discover(pool, target)

    async def _watch(self, pool: ModelPool, worker: Worker) -> None:
        """Follows a worker's health until it leaves; describes it when it serves."""
        interval = self.config.health_check_interval
        delay = 0.05
        described = False
        self._spawn(self._follow_load(pool, worker))
        self._spawn(follow_kv(pool, worker))  # returns at once unless routing reads events
        self._spawn(follow_loads(pool, worker))  # and unless it reads /metrics (openai)
        while not worker.leaving:
            try:
                checks = worker.upstream.watch_health(interval, self.config.health_check_timeout)
                async for serving in checks:
                    if serving and not described:
                        described = await self._describe(pool, worker)
                    if serving != worker.serving:
                        log.info(
                            "worker %s: %s", worker.address, "serving" if serving else "not serving"
                        )
                    worker.serving = serving
                    delay = 0.05
            except errors.GatewayError as error:
                if worker.leaving:
                    break  # its channel was closed behind it
                if worker.serving is not False:
                    log.warning("worker %s unreachable: %s", worker.address, error.message)
                worker.serving = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, interval, 1.0)  # a worker that comes back is seen soon

    async def _follow_load(self, pool: ModelPool, worker: Worker) -> None:
        """Describes a serving worker again every health interval, for the load and
        fullness it reports (what other gateways send it, a vLLM engine's queue)."""
        interval = self.config.health_check_interval
        while not worker.leaving:
            await asyncio.sleep(interval)
            if worker.serving:
                await self._describe(pool, worker, quiet=True)

    async def _describe(self, pool: ModelPool, worker: Worker, quiet: bool = False) -> bool:
        try:
            models = await worker.upstream.describe(DESCRIBE_TIMEOUT)
        except errors.GatewayError as error:
            if not quiet:
                log.warning("worker %s did not describe itself: %s", worker.address, error.message)
            return False
        served = {m.name: m.max_context for m in models}
        mine = next((m for m in models if m.name == pool.name), None)
        if mine is not None:
            worker.capacity, worker.full = mine.capacity, mine.full
            worker.features = mine.features
            worker.reported_load = mine.load or 0
        adapters = frozenset(served).difference((pool.name,))
        if adapters != worker.adapters:  # what it lists now: a restart forgot the loads
            worker.adapters = adapters
        unfit = misfit(pool, worker.address, served, mine)
        state = None if unfit is None else unfit[0]
        if unfit is not None and state != worker.misfit:  # said once, not at every follow-up
            log.error("%s: kept out of the rotation", unfit[1])
        elif not quiet and (idle := idle_engines(pool, worker.address, mine)):
            log.warning(idle)
        worker.misfit = state
        if state is None and pool.max_context is None:
            pool.max_context = served[pool.name]
        return True

    # -- requests -----------------------------------------------------------

    def get(self, name: str) -> ModelPool:
        """The LLM pool a request names (the edge picks a team's first when it names
        none: `admission.admit.resolve`)."""
        pool = self.models.get(name)
        if pool is None:
            raise errors.ModelNotFound(f"The model `{name}` does not exist.", param="model")
        if pool.kind != "llm":
            raise errors.NotAnLLM(
                f"The model `{name}` is a tensor model: send it to "
                f"POST /v2/models/{name}/infer (the KServe v2 inference protocol).",
                param="model",
            )
        return pool

    async def start_call(
        self,
        pool: ModelPool,
        request: GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...] = (),
        record: RequestRecord | None = None,
    ) -> tuple[Started, UpstreamCall]:
        """Starts the request on a worker and waits for its `Started`, retrying
        retryable refusals on other workers; returns that event and the call
        (`record` gets the routing decision, with `models[].routing`)."""
        if pool.prefill is not None and pool.available(set()):  # a decode worker to take it
            timeout = min(self.config.start_timeout, deadline.remaining())
            request = await prefilled(pool.prefill, request, timeout, metadata, record)
        attempt = partial(self._try, pool, request, deadline, metadata, record=record)
        return await with_retries(
            self, pool, deadline, attempt, _retryable, self.config.retry_backoff
        )

    async def _try(
        self,
        pool: ModelPool,
        request: GenerateRequest,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
        tried: set[Worker],
        record: RequestRecord | None = None,
    ) -> tuple[Started, UpstreamCall]:
        """One try: a call on a worker of `pool` not yet `tried`, and its `Started`
        within `start_timeout`."""
        if pool.router is not None:
            await pool.router.prepare(request, pool.workers.values())
        worker = pool.pick(request, tried)
        if worker is None:
            raise pool.no_worker()
        if record is not None and pool.router is not None:
            route = pool.router.last
            record.policy, record.cache_hit_blocks = route.policy, route.cache_hit_blocks
        tried.add(worker)
        if pool.base is not None:  # a LoRA adapter: loaded on the worker first
            await pool.ready(worker, deadline)
        worker.count_call(1)
        call = worker.upstream.call(
            request, deadline.remaining(), metadata, on_close=worker.release
        )
        start_timeout = self.config.start_timeout
        remaining = deadline.remaining()
        bounded_by_deadline = remaining <= start_timeout
        try:
            with _StartTimeout(min(start_timeout, remaining)):
                first = await anext(call, None)
        except TimeoutError:
            if bounded_by_deadline:
                call.cancel()
                raise errors.Timeout(
                    "The engine worker did not start the answer in time."
                ) from None
            failure: errors.EngineError = errors.Unavailable(
                f"The engine worker did not start the answer within {start_timeout:g} seconds."
            )
            call.cancel(failure)
            raise failure from None
        except errors.ModelNotFound:
            if isinstance(pool, AdapterPool) and pool.forget(worker):
                tried.discard(worker)  # it restarted and forgot it: load it there again
            raise
        except errors.GatewayError:
            raise
        except BaseException:
            call.cancel()
            raise
        if not isinstance(first, Started):
            failure = errors.Failed("The engine worker did not start the answer properly.")
            call.cancel(failure)
            raise failure
        return first, call

    def snapshot(self) -> dict[str, object]:
        """Every model's workers and their state, for operators."""
        now = time.monotonic()
        return {
            "models": [
                {
                    "name": pool.name,
                    "kind": pool.kind,
                    "max_context": pool.max_context,
                    "balance": type(pool.balancer).__name__,
                    "retries_total": pool.retries_total,
                    **({} if pool.base is None else {"adapter_of": pool.base.name}),
                    "workers": _workers_view(pool, now),
                    **(
                        {}
                        if pool.prefill is None
                        else {
                            "prefill_workers": _workers_view(pool.prefill, now),
                            "prefills_total": dict(pool.prefill.prefills),
                        }
                    ),
                }
                for pool in self.models.values()
            ]
        }


def _workers_view(pool: ModelPool, now: float) -> list[dict[str, object]]:
    """A pool's workers and their state, as `Fleet.snapshot` shows them."""
    return [
        {
            "address": w.address,
            "state": w.state,
            "outstanding": w.outstanding,
            "reported_load": w.reported_load,
            "full": w.full,
            "weight": w.weight,
            "consecutive_failures": w.consecutive_failures,
            "ejections_total": w.ejections_total,
            "ejected_for": round(max(0.0, w.ejected_until - now), 3),
            **({"adapters": sorted(w.adapters)} if w.adapters else {}),
            # a data-parallel engine's rank (`data_parallel.py`: its server's I-th engine)
            **({} if (rank := engine_rank_of(w)) is None else {"engine_rank": rank}),
            **({} if pool.router is None else {"routing": pool.router.view(w.address)}),
        }
        for w in pool.workers.values()
    ]
