"""The fleet's figures for `/metrics`: retries and healthy workers per model, and
each worker's calls in flight, health and ejections (a LoRA adapter's workers are
its base's: counted once, under the base; which hold the adapter, and its loads),
read from the live pools at scrape time (nothing is counted twice on the request
path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.fleet.adapters import AdapterPool
from gateway.telemetry import PREFIX, LiveCollector

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker


class FleetCollector(LiveCollector):
    """Retries and per-worker figures, read when Prometheus scrapes."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        retries = CounterMetricFamily(
            f"{PREFIX}_retries", "Tries on another worker before the first event.", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            f"{PREFIX}_worker_inflight_requests",
            "Calls in flight per worker.",
            labels=["model", "worker"],
        )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_worker_healthy",
            "1 when the worker takes new requests.",
            labels=["model", "worker", "state"],
        )
        # per model, 0 included: a model without a worker (none discovered, every pod
        # gone) has no worker series at all, and an alert on those would stay silent
        model_healthy = GaugeMetricFamily(
            f"{PREFIX}_model_healthy_workers",
            "Workers of the model that take new requests (0: none).",
            labels=["model"],
        )
        ejections = CounterMetricFamily(
            f"{PREFIX}_worker_ejections",
            "Passive ejections per worker.",
            labels=["model", "worker"],
        )
        now = time.monotonic()
        for pool in self.fleet.models.values():
            retries.add_metric([pool.name], pool.retries_total)
            if isinstance(pool, AdapterPool):  # its workers' series are its base's
                model_healthy.add_metric([pool.name], _adapter_healthy(pool, now))
                continue
            available = 0
            # a model's prefill workers (`prefill_workers`) are its workers too, counted apart
            for worker in [*pool.workers.values(), *_prefill_workers(pool)]:
                labels = [pool.name, worker.address]
                inflight.add_metric(labels, worker.outstanding)
                up = 1 if worker.available(now) else 0
                available += up if worker.address in pool.workers else 0
                healthy.add_metric([*labels, worker.state], up)
                ejections.add_metric(labels, worker.ejections_total)
            model_healthy.add_metric([pool.name], available)
        yield from (retries, inflight, healthy, model_healthy, ejections)
        yield from _prefills(self.fleet, now)
        yield from _adapters(self.fleet)
        yield from _routing(self.fleet)


def _prefill_workers(pool: ModelPool) -> list[Worker]:
    return [] if pool.prefill is None else list(pool.prefill.workers.values())


def _prefills(fleet: Fleet, now: float) -> Iterator[Metric]:
    """Prefill/decode disaggregation (`models[].prefill_workers`): the prefill workers that
    take prefills, and the prefills by outcome."""
    healthy = GaugeMetricFamily(
        f"{PREFIX}_model_healthy_prefill_workers",
        "Prefill workers of the model that take prefills (0: none; its decode workers then "
        "prefill themselves).",
        labels=["model"],
    )
    prefills = CounterMetricFamily(
        f"{PREFIX}_prefills",
        "Prompts prefilled on a prefill worker, by outcome: transferred (its KV blocks pulled "
        "by the decode worker), failed, no_worker (the decode worker prefilled them).",
        labels=["model", "outcome"],
    )
    for pool in fleet.models.values():
        if pool.prefill is None:
            continue
        workers = pool.prefill.workers.values()
        healthy.add_metric([pool.name], sum(1 for w in workers if w.available(now)))
        for outcome, count in pool.prefill.prefills.items():
            prefills.add_metric([pool.name, outcome], count)
    yield from (healthy, prefills)


def _adapter_healthy(pool: AdapterPool, now: float) -> int:
    """An adapter's workers that take its requests: its base's available workers that
    hold it, or, with a path to load it from, all of them."""
    workers = [w for w in pool.workers.values() if w.available(now)]
    return len(workers if pool.path is not None else [w for w in workers if pool.holds(w)])


def _adapters(fleet: Fleet) -> Iterator[Metric]:
    """LoRA adapters (`models[].adapter_of`): which workers hold each, and its loads."""
    held = GaugeMetricFamily(
        f"{PREFIX}_worker_adapter_loaded",
        "1 for each worker that serves the LoRA adapter (lists it, or it was loaded there).",
        labels=["model", "worker"],
    )
    loads = CounterMetricFamily(
        f"{PREFIX}_adapter_loads",
        "Loads of the LoRA adapter on a worker by this gateway, by outcome (loaded, failed).",
        labels=["model", "outcome"],
    )
    for pool in fleet.models.values():
        if not isinstance(pool, AdapterPool):
            continue
        for worker in pool.workers.values():
            if pool.holds(worker):
                held.add_metric([pool.name, worker.address], 1)
        for outcome in ("loaded", "failed"):
            loads.add_metric([pool.name, outcome], pool.loads_total[outcome])
    yield from (held, loads)


def _routing(fleet: Fleet) -> Iterator[Metric]:
    """Routing on the engines' KV events (`models[].routing`): each model's index and,
    per worker, its cached blocks, its events' state and lag, what was refused."""
    labels = ["model", "worker"]
    blocks = GaugeMetricFamily(
        f"{PREFIX}_worker_kv_cached_blocks", "KV blocks the index holds per worker.", labels=labels
    )
    events = GaugeMetricFamily(
        f"{PREFIX}_worker_kv_events",
        "1 for the state of the worker's KV-event stream (events, unsupported, broken, none).",
        labels=[*labels, "state"],
    )
    scrape = GaugeMetricFamily(
        f"{PREFIX}_worker_load_scrape",
        "1 for the state of an openai worker's /metrics read for its engine's load record "
        "(loads, unsupported, broken).",
        labels=[*labels, "state"],
    )
    lag = GaugeMetricFamily(
        f"{PREFIX}_worker_kv_event_lag_seconds",
        "Seconds between the worker sending its last KV batch and the gateway applying it.",
        labels=labels,
    )
    refused = CounterMetricFamily(
        f"{PREFIX}_worker_kv_events_refused",
        "KV events refused (malformed, out of order, over the bounds) and resyncs.",
        labels=labels,
    )
    evicted = CounterMetricFamily(
        f"{PREFIX}_worker_kv_blocks_evicted",
        "Blocks the index forgot past its per-worker cap.",
        labels=labels,
    )
    memory = GaugeMetricFamily(
        f"{PREFIX}_kv_index_bytes", "Estimated memory of the model's KV index.", labels=["model"]
    )
    fallbacks = CounterMetricFamily(
        f"{PREFIX}_routing_fallbacks",
        "Requests routed without KV events (no worker of the tier publishes them), by tier: "
        "workers, prefill_workers (a split model's prefills).",
        labels=["model", "tier"],
    )
    for model in fleet.models.values():
        # a model's prefill workers (`prefill_workers`) are routed apart, on an index of
        # their own: both counted under the model (its fallbacks by tier)
        routed = [(p, p.router) for p in (model, model.prefill) if p is not None and p.router]
        if not routed:
            continue
        memory.add_metric([model.name], sum(r.index.memory_bytes() for _, r in routed))
        for pool, router in routed:
            tier = "workers" if pool is model else "prefill_workers"
            fallbacks.add_metric([model.name, tier], router.fallbacks_total)
        for pool, router, address in ((p, r, a) for p, r in routed for a in p.workers):
            index = router.index
            kv = index.workers.get(address)
            state = router.view(address)["events"]
            events.add_metric([pool.name, address, str(state)], 1)
            scraped = router.scrapes.get(address)
            if scraped is not None:
                scrape.add_metric([pool.name, address, scraped], 1)
            blocks.add_metric([pool.name, address], 0 if kv is None else len(kv.blocks))
            if kv is not None:
                lag.add_metric([pool.name, address], kv.lag)
                subscriber = router.zmq.get(address)  # and its ZMQ messages refused whole
                malformed = 0 if subscriber is None else subscriber.malformed
                refused.add_metric([pool.name, address], kv.refused + malformed)
                evicted.add_metric([pool.name, address], kv.evicted)
    yield from (blocks, events, scrape, lag, refused, evicted, memory, fallbacks)
