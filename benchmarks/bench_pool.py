"""What a model's pool costs a request as the fleet grows: the CPU of `ModelPool.saturated`
(admission's load shedding asks it), `ModelPool.features` (the edge checks the request's
parameters against it) and `ModelPool.pick` (the balancer over the workers available
now), then the call's `outstanding` count up and its release, as a request makes them, on
pools of 10 to 1,000 idle healthy workers (no gRPC: `Worker(address, None, ...)` as
`sim_routing.py` builds them; the pool's own `update`, as discovery, makes them join).

Policies: `least_outstanding` (power of two choices), `prefix_affinity` (consistent
hashing), and `routing: {policy: kv_aware}` with an empty KV index (no events yet: it
falls back to prefix affinity, the path of a fleet whose engines do not publish).

CPU time of this process (`time.process_time`), the best of several rounds, as other load
on a shared machine only adds. Run: `python benchmarks/bench_pool.py [--workers 10,100,1000]`.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from gateway.config import Config, ModelConfig, RoutingConfig
from gateway.fleet.pool import ModelPool
from gateway.protocol.types import GenerateRequest

POLICIES: dict[str, dict[str, Any]] = {
    "least_outstanding": {},
    "prefix_affinity": {"balance": "prefix_affinity"},
    "routing: kv_aware (empty index)": {"routing": RoutingConfig(policy="kv_aware")},
}
REQUESTS = 200


def make_pool(workers: int, options: dict[str, Any]) -> ModelPool:
    """A pool of `workers` healthy workers, joined through `update` as discovery does."""
    addresses = [f"10.0.{w // 256}.{w % 256}:8000" for w in range(workers)]
    model = ModelConfig("m", workers=("10.0.0.0:8000",), **options)
    pool = ModelPool(model, Config(models=(model,)), lambda address: None)  # type: ignore[arg-type,return-value]
    pool.update(pool.targets[0], addresses, lambda worker: None)
    for worker in pool.workers.values():
        worker.serving = True
    return pool


def cost(pool: ModelPool, requests: list[GenerateRequest], rounds: int) -> float:
    """Microseconds of CPU a request: the best round over every request."""
    best = float("inf")
    nobody: set[object] = set()
    for _ in range(rounds):
        start = time.process_time()
        for request in requests:
            if pool.saturated() or pool.features() is not None:
                raise AssertionError("an idle pool of undescribed workers")
            worker = pool.pick(request, nobody)  # type: ignore[arg-type]
            assert worker is not None
            worker.outstanding += 1
            worker.release(None)
        best = min(best, time.process_time() - start)
    return best / len(requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(1)
    prompts = [" ".join(str(rng.randrange(10**6)) for _ in range(64)) for _ in range(REQUESTS)]
    requests = [GenerateRequest("m", prompt=p) for p in prompts]
    sizes = [int(w) for w in args.workers.split(",")]
    print("| policy | " + " | ".join(f"{n:,} workers" for n in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    for name, options in POLICIES.items():
        cells = [cost(make_pool(n, options), requests, args.rounds) for n in sizes]
        print(f"| {name} | " + " | ".join(f"{c:,.1f} µs" for c in cells) + " |")


if __name__ == "__main__":
    main()
