"""A model as the gateway serves it: its workers, found from the config's
entries, and the balancer that picks among those available.

What a request asks of the pool costs the same whatever the fleet's size: who is
available (`available`, a `Roster`), what the workers serve (`features`) are kept
until a worker changes (its `watcher` says so; membership changes here) or an
ejection ends, and `saturated` asks first the worker that had room the last time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal, cast

from gateway.config import Config, ModelConfig
from gateway.fleet.balancing import Balancer, LeastOutstanding, PrefixAffinity, Roster
from gateway.fleet.data_parallel import engines, rank_entries
from gateway.fleet.discovery import Target, parse_target
from gateway.fleet.routing import Router
from gateway.fleet.worker import EjectionPolicy, Worker
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import GenerateRequest
from gateway.upstreams.base import Upstream

log = logging.getLogger("furnace.fleet")


#: How a prefill on a `prefill_workers` worker ended: its KV blocks handed to the decode
#: worker; failed (the decode worker prefilled itself); no prefill worker available.
PREFILL_OUTCOMES = ("transferred", "failed", "no_worker")
#: A split model's tier (`ModelPool.kv_tier`).
KvTier = Literal["prefill", "decode"]


def make_balancer(model: ModelConfig, config: Config) -> Balancer:
    """The model's balancing policy: its `routing:` (`routing.Router`), else `balance`."""
    prefix = PrefixAffinity(config.affinity_prefix_chars, config.affinity_load_factor)
    if model.routing is not None:
        # `kv_events` names the ZMQ publishers of its workers and its prefill workers (a
        # pool of their own): each pool's router subscribes to its own workers'
        # (and one entry an engine of a data-parallel server, at its own port)
        size = model.data_parallel_size
        routing = replace(
            model.routing,
            kv_events=rank_entries(
                (e for e in model.routing.kv_events if e[0] in model.workers), size
            ),
            kv_replay=rank_entries(
                (e for e in model.routing.kv_replay if e[0] in model.workers), size
            ),
        )
        return Router(model.name, routing, prefix, tokenizer=model.tokenizer)
    if model.balance == "prefix_affinity":
        return prefix
    return LeastOutstanding()


class ModelPool:
    """The workers of one model; membership changes as discovery answers."""

    def __init__(
        self,
        model: ModelConfig,
        config: Config,
        make_upstream: Callable[[str], Upstream],
        prefill_tier: bool = False,
    ) -> None:
        """`prefill_tier`: the pool of a split model's prefill workers (`Fleet`)."""
        self.name = model.name
        self.make_upstream = make_upstream
        self.kind = model.kind
        #: How its rerank and score requests are scored (`models[].scoring`).
        self.scoring = model.scoring
        self.max_context = model.max_model_len
        #: The operator's cap on a request's `max_tokens` (`models[].max_tokens_limit`).
        self.max_tokens_limit = model.max_tokens_limit
        #: Whether the answers' finish reasons are the upstream's own (an OpenAI-compatible
        #: server decided them), rather than events the gateway turns into an answer.
        self.relays_answers = model.upstream == "openai"
        #: Its tier of a split model (`prefill_workers`): "prefill" (its workers hand KV
        #: blocks on), "decode" (its workers take them); None: not split. A worker without
        #: a KV connector is kept out of either (`fit.NO_KV_CONNECTOR`), and one whose
        #: connector's role is the other tier's (`fit.WRONG_KV_ROLE`).
        self.kv_tier: KvTier | None = (
            None if not model.prefill_workers else "prefill" if prefill_tier else "decode"
        )
        self.targets: list[Target] = [parse_target(entry) for entry in model.workers]
        #: Engines a worker's server runs (`data_parallel`): each a worker of the pool.
        self.data_parallel_size = model.data_parallel_size
        self.balancer = make_balancer(model, config)
        self._unary = LeastOutstanding()
        #: The balancer when the model has `routing:` (its KV index, the reason of a pick).
        self.router = self.balancer if isinstance(self.balancer, Router) else None
        self.policy = EjectionPolicy(
            config.eject_after_failures, config.eject_base, config.eject_max
        )
        self.workers: dict[str, Worker] = {}
        self.retries_total = 0
        self._weights = dict(model.weights)
        self._found: dict[str, set[str]] = {}  # entry -> addresses it gave
        self._weight_of: dict[str, float] = {}
        #: Workers whose upstream was replaced, finishing their calls on the old one.
        self.retired: list[Worker] = []
        # kept between changes (`_changed`): who is available, until the first ejection
        # among them ends; what they serve; the worker that had room at the last look
        self._roster: Roster | None = None
        self._roster_until = math.inf
        self._features: frozenset[str] | None = None
        self._features_stale = True
        self._room: Worker | None = None
        #: The model this one is a LoRA adapter of (`adapters.AdapterPool`, which shares
        #: its workers); None for a model with workers of its own.
        self.base: ModelPool | None = None
        #: The workers that prefill its prompts (`models[].prefill_workers`), a pool of
        #: their own; None: its workers prefill and decode.
        self.prefill: ModelPool | None = None
        #: Prefills by outcome (`PREFILL_OUTCOMES`), for /metrics.
        self.prefills = dict.fromkeys(PREFILL_OUTCOMES, 0)

    def _changed(self, worker: Worker, name: str, old: object) -> None:
        """A worker's watched field changed (`Worker.watcher`), or it joined or left: a
        call in flight more or less counts in the roster; anything else makes the roster
        and the features be made again when next asked."""
        roster = self._roster
        if name == "outstanding":
            if roster is not None and worker in roster.members:
                roster.outstanding += worker.outstanding - cast(int, old)
            return
        self._roster = None
        self._features_stale = True

    def _current(self, now: float) -> Roster:
        """The workers available at `now`: the kept roster, or a new one."""
        roster = self._roster
        if roster is None or now >= self._roster_until:
            workers = self.workers.values()
            roster = self._roster = Roster(w for w in workers if w.available(now))
            ends = (w.ejected_until for w in workers if w.ejected_until > now)
            self._roster_until = min(ends, default=math.inf)
        return roster

    def available(self, exclude: set[Worker]) -> list[Worker]:
        """Workers that may take a new request now (the pool's `Roster` when `exclude` is
        empty: read it, never change it)."""
        roster = self._current(time.monotonic())
        return [w for w in roster if w not in exclude] if exclude else roster

    def saturated(self) -> bool:
        """Whether every worker that may take a request is full: it says so (a vLLM engine
        queueing), or it runs as many requests as the capacity it reports, counting this
        gateway's calls now and every client's at its last report (other replicas'), or
        its engine's load record says its queue or KV cache is full (`routing`'s
        `max_engine_waiting`, `max_kv_usage`); False while any of them does not report.
        The worker that had room at the last look is asked first: a look over the fleet
        only once it is full."""
        now = time.monotonic()
        roster = self._current(now)
        room = self._room
        if room is not None and room in roster.members and self.has_room(room, now):
            return False
        self._room = next((w for w in roster if self.has_room(w, now)), None)
        return bool(roster) and self._room is None

    def busy_share(self) -> float | None:
        """How much of the capacity of its available workers that report one is taken
        (a worker that says it is full: all of its), as `saturated` counts it; None while
        none reports a capacity."""
        taken = capacity = 0
        for worker in self._current(time.monotonic()):
            if worker.capacity is None:
                continue
            capacity += worker.capacity
            load = max(worker.outstanding, worker.reported_load)
            taken += worker.capacity if worker.full else min(load, worker.capacity)
        return taken / capacity if capacity else None

    def has_room(self, worker: Worker, now: float) -> bool:
        router = self.router
        return not (
            worker.full
            or (
                worker.capacity is not None
                and max(worker.outstanding, worker.reported_load) >= worker.capacity
            )
            or (router is not None and router.sheds and router.engine_full(worker.address, now))
        )

    async def ready(self, worker: Worker, deadline: Deadline) -> None:
        """What a call on `worker` needs first: nothing, but for an adapter
        (`AdapterPool`: its load); called where `base` is set."""

    def features(self) -> frozenset[str] | None:
        """What every described worker of the model serves (`gateway.protocol.features`);
        None while none has described itself (the worker then refuses for itself)."""
        if self._features_stale:
            described = [w.features for w in self.workers.values() if w.features is not None]
            self._features = frozenset.intersection(*described) if described else None
            self._features_stale = False
        return self._features

    def pick(self, request: GenerateRequest, exclude: set[Worker]) -> Worker | None:
        """The worker for a request among those not yet tried, or None."""
        candidates = self.available(exclude)
        if not candidates:
            return None
        return self.balancer.pick(candidates, request)

    def no_worker(self) -> errors.Unavailable:
        """The refusal of a call when no worker is left to try."""
        return errors.Unavailable(f"No healthy worker is available for the model `{self.name}`.")

    def pick_for_unary(self, exclude: set[Worker]) -> Worker | None:
        """The worker for a unary call (an embedding, a tensor inference: no prompt prefix
        for affinity or KV routing to follow) among those not yet tried, the less loaded
        of two, or None."""
        candidates = self.available(exclude)
        return self._unary.pick_any(candidates) if candidates else None

    def update(
        self,
        target: Target,
        addresses: list[str],
        on_join: Callable[[Worker], None],
    ) -> None:
        """Sets what one entry resolves to: new addresses join (`on_join` starts
        watching them); addresses no entry gives any more leave once idle."""
        addresses = engines(addresses, self.data_parallel_size)
        self._found[target.entry] = set(addresses)
        weight = self._weights.get(target.entry, 1.0)
        for address in addresses:
            self._weight_of[address] = weight
            worker = self.workers.get(address)
            if worker is None:
                upstream = self.make_upstream(address)
                worker = Worker(address, upstream, self.policy, weight, watcher=self._changed)
                self.workers[address] = worker
                self._changed(worker, "joined", None)
                log.info("model %s: worker %s joins", self.name, address)
                on_join(worker)
            elif worker.leaving:
                worker.leaving = False
                log.info("model %s: worker %s is back", self.name, address)
        wanted = set().union(*self._found.values())
        for address, worker in self.workers.items():
            if address not in wanted and not worker.leaving:
                worker.leaving = True
                log.info("model %s: worker %s leaves after its calls end", self.name, address)

    def replace_upstreams(self, make_upstream: Callable[[str], Upstream]) -> list[Worker]:
        """Every worker gets a new upstream (new TLS credentials) and keeps its state:
        new calls go to the new upstream, calls in flight end on the old one, which
        `idle_leavers` gives back once idle. Returns the new workers."""
        self.make_upstream = make_upstream
        fresh: list[Worker] = []
        for address, old in list(self.workers.items()):
            if old.leaving:
                continue  # it goes anyway, on its old upstream
            new = replace(old, upstream=make_upstream(address), outstanding=0)
            old.leaving = True
            self.workers[address] = new
            self._changed(new, "joined", None)
            self.retired.append(old)
            fresh.append(new)
        return fresh

    def idle_leavers(self) -> list[Worker]:
        """Workers that left (or whose upstream was replaced) and have no call in
        flight: ready to be closed."""
        gone = [w for w in self.workers.values() if w.leaving and w.outstanding == 0]
        for worker in gone:
            del self.workers[worker.address]
            self._changed(worker, "left", None)
        retired = [w for w in self.retired if w.outstanding == 0]
        self.retired = [w for w in self.retired if w.outstanding > 0]
        return gone + retired
