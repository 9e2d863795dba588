"""The KV index and the kv_aware scorer past this machine's fleet: a simulated fleet of
workers, each holding chains of cached blocks as their engines' events would store them,
fed through the index as real batches (`KvIndex.apply`), then scored as the router scores a
request (`Router.pick` over every worker). It prints, for each fleet size:

- the index's memory (traced by `tracemalloc`, and per (worker, block) pair),
- events ingested per second on one core (blocks stored through `apply`, chains hashed;
  CPU time of the process, so other load on a shared machine counts less),
- the scorer's CPU per request (`Router.pick`, the best of 31 rounds or more; an 8,000-token
  prompt: 500 blocks of 16 tokens) with every worker a candidate, for two prompts: a new
  one that no worker holds (the walk through the index stops at its first block), and one
  that starts with a document (100 blocks) that `--holders` workers hold, then a new
  conversation (the walk hashes 101 blocks); and for a prompt `--holders` workers hold
  whole (the walk hashes all 500 blocks: a conversation's next turn).

The blocks are named by the C functions of `gateway/protocol/_kv_blocks.c` when the
package was built with them (`--python`: by kv_blocks' Python functions, as an install
without a compiler does).

The documents are ASCII, as the text fallback hashes a prompt's UTF-8 bytes: each worker
holds a random `--blocks` worth of them, and there are as many documents as make each one
held by `--holders` workers on average (a fleet's caches hold mostly different prompts).

Blocks per worker are scaled down to fit a shared 2-core VM (a full 1,000 x 100,000 needs
~20 GB in CPython); memory is linear in (worker, block) pairs, so the per-pair figure
extrapolates. Run: `python benchmarks/sim_routing.py [--workers 10,100,1000] [--blocks N]
[--holders N] [--python]`.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from dataclasses import dataclass

from gateway.config import RoutingConfig
from gateway.fleet import kv_index
from gateway.fleet.balancing import PrefixAffinity, Roster
from gateway.fleet.routing import Router
from gateway.fleet.worker import EjectionPolicy, Worker
from gateway.protocol import kv_blocks
from gateway.protocol.kv_blocks import BlocksStored, KvBatch
from gateway.protocol.types import GenerateRequest

BLOCK = 16
DOC_BLOCKS = 100  # a document (system prompt, shared context) of 1,600 tokens
PROMPT_TOKENS = 8_000
_ASCII = bytes(range(128)) * 2  # a byte -> one below 128


@dataclass
class Point:
    workers: int
    pairs: int
    distinct: int
    memory: int
    ingest_blocks_per_s: float
    score_new_us: float
    score_held_us: float
    score_whole_us: float


def _text(rng: random.Random, size: int) -> bytes:
    """Random ASCII: its UTF-8 bytes, the text fallback's tokens, are itself."""
    return rng.randbytes(size).translate(_ASCII)


def simulate(workers: int, blocks_per_worker: int, holders: int, seed: int = 1) -> Point:
    """One fleet: every worker stores random documents up to its share of blocks."""
    rng = random.Random(seed)
    per_worker = blocks_per_worker // DOC_BLOCKS
    documents = max(per_worker, workers * per_worker // holders)
    docs = [_text(rng, DOC_BLOCKS * BLOCK) for _ in range(documents)]
    router = Router(
        "sim", RoutingConfig(max_blocks_per_worker=blocks_per_worker * 2), PrefixAffinity()
    )
    index = router.index
    whole = _text(rng, PROMPT_TOKENS)  # a conversation `holders` workers hold whole
    batches = []
    for w in range(workers):
        address = f"10.0.{w // 256}.{w % 256}:8000"
        engine_hash = w << 32
        stored = rng.sample(docs, per_worker) + ([whole] if w < holders else [])
        for sequence, doc in enumerate(stored, start=1):
            size = len(doc) // BLOCK
            hashes = tuple(range(engine_hash, engine_hash + size))
            engine_hash += size
            batch = KvBatch(sequence, (BlocksStored(hashes, None, doc, BLOCK),), sequence == 1)
            batches.append((address, batch))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for address, batch in batches:
        index.apply(address, batch)
    memory = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # ingest again, untraced, into a fresh index: CPU seconds of this process only
    router = Router("sim", router.config, PrefixAffinity())
    index = router.index
    start = time.process_time()
    for address, batch in batches:
        index.apply(address, batch)
    spent = time.process_time() - start
    stored = sum(len(b.events[0].block_hashes) for _, b in batches)
    pairs = sum(len(kv.blocks) for kv in index.workers.values())
    policy = EjectionPolicy()
    fleet = [Worker(address, None, policy) for address in index.workers]  # type: ignore[arg-type]
    new = [_text(rng, PROMPT_TOKENS) for _ in range(64)]
    held = [docs[rng.randrange(documents)] + t[: -DOC_BLOCKS * BLOCK] for t in new]
    scores = [_score(router, fleet, prompts) for prompts in (new, held, [whole])]
    return Point(workers, pairs, len(index.holders), memory, stored / spent, *scores)


def _score(router: Router, fleet: list[Worker], prompts: list[bytes]) -> float:
    """Microseconds of CPU a `pick` over the fleet as the pool passes it (its `Roster`,
    kept between changes): the best of several rounds over every prompt, as other work
    on the machine only adds."""
    requests = [GenerateRequest("sim", prompt=p.decode()) for p in prompts]
    roster = Roster(fleet)
    best = float("inf")
    for _ in range(max(31, 2000 // len(fleet), 128 // len(prompts))):
        start = time.process_time()
        for request in requests:
            router.pick(roster, request)
        best = min(best, time.process_time() - start)
    return best / len(requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--blocks", type=int, default=2_000, help="blocks per worker")
    parser.add_argument("--holders", type=int, default=4, help="workers a document")
    parser.add_argument(
        "--python", action="store_true", help="name blocks in Python, not with the C functions"
    )
    args = parser.parse_args()
    if args.python:
        kv_index.chain, kv_index.walk = kv_blocks._chain, kv_blocks._walk
    print(
        "| workers | (worker, block) pairs | distinct blocks | index memory | bytes a pair "
        "| blocks ingested/s (1 core) | scoring µs/request, new prompt "
        f"| scoring µs/request, a document {args.holders} workers hold "
        f"| scoring µs/request, a prompt {args.holders} workers hold whole |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workers in (int(w) for w in args.workers.split(",")):
        p = simulate(workers, args.blocks, args.holders)
        print(
            f"| {p.workers:,} | {p.pairs:,} | {p.distinct:,} | {p.memory / 2**20:,.1f} MiB "
            f"| {p.memory / max(p.pairs, 1):.0f} | {p.ingest_blocks_per_s:,.0f} "
            f"| {p.score_new_us:,.1f} | {p.score_held_us:,.1f} | {p.score_whole_us:,.1f} |"
        )


if __name__ == "__main__":
    main()
