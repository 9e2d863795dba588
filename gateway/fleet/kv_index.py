"""Which worker of a model holds which KV-cache blocks, from the engines' own events.

One `KvIndex` per model. Each worker that publishes events has a `WorkerKv`: a slot (a
bit), its blocks as {engine hash: gateway hash} (removals name the engine's hash), the
last batch's sequence number and its last load record. `holders` maps a gateway hash
(`gateway.protocol.kv_blocks.chain`, computed from the events' token ids) to the bits of
the workers that hold it, so `match` walks a request's chain once for the whole fleet:
a dict lookup a block matched, and a big-int AND where the holders change, whatever the
number of workers (1,000 workers are 16 machine words a block).

Resynchronization: a batch whose sequence is not the next one (a gap: events lost) or
that says `reset` drops what the index knew of the worker before applying it; a batch
numbered at or below the last one is a duplicate (or a load record only, as vLLM's
heartbeats are) and applies nothing but its load. A worker that leaves, or whose stream
breaks, is `drop`ped whole: the router then treats it as holding nothing.

Bounds, since an engine (or whatever answers at its address) is not trusted: at most
`cap` blocks per worker (past it, the oldest eighth is forgotten, counted in
`evicted`), at most `max_batch_blocks` blocks a batch (a bigger batch is refused whole
and the worker's part dropped, as for a gap), token ids that do not fill the blocks
they claim refuse the event. Each refusal is counted and logged at most once a minute a
worker; none raises into routing.

Memory: 80-86 bytes a (worker, block) pair in CPython, distinct blocks included (their
sets of holders shared: one int for each set), as `benchmarks/sim_routing.py` measured
it (160 MiB for 1,000 workers x 2,000 blocks, a quarter of them distinct).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from gateway.protocol.kv_blocks import (
    ROOT,
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    chain,
    walk,
)

log = logging.getLogger("furnace.fleet.kv")

#: Blocks per worker by default: ~1.6 TB of KV at 16 tokens x 1 MB a block covers any
#: GPU worker; `routing.max_blocks_per_worker` sets it.
DEFAULT_CAP = 200_000
#: Blocks one batch may store or remove (vLLM sends a step's worth: tens to hundreds).
MAX_BATCH_BLOCKS = 65_536
#: Sets of holders kept past those in use before they are counted again (`_prune_sets`).
SETS_SLACK = 4096
#: Seconds between two warnings about one worker's events.
WARN_EVERY = 60.0


class WorkerKv:
    """What the index knows of one worker."""

    __slots__ = (
        "address",
        "bit",
        "block_size",
        "blocks",
        "events_at",
        "evicted",
        "lag",
        "load",
        "load_at",
        "refused",
        "resets",
        "sequence",
        "slot",
        "warned_at",
    )

    def __init__(self, address: str, slot: int) -> None:
        self.address = address
        self.slot = slot
        self.bit = 1 << slot
        #: Engine hash -> gateway hash, oldest first.
        self.blocks: dict[int, int] = {}
        self.sequence = -1  # none yet
        self.block_size = 0
        self.load: EngineLoad | None = None
        self.load_at = 0.0
        self.events_at = 0.0  # monotonic time of the last batch
        self.lag = 0.0  # seconds between the batch's time stamp and its arrival, when known
        self.evicted = 0
        self.refused = 0
        self.resets = 0
        self.warned_at = -WARN_EVERY


class KvIndex:
    """The blocks every worker of one model holds; fed by `apply`, read by `match`."""

    def __init__(
        self,
        model: str,
        cap: int = DEFAULT_CAP,
        max_batch: int = MAX_BATCH_BLOCKS,
        full: Callable[[EngineLoad], bool] | None = None,
    ) -> None:
        """`full`: whether a load record says its engine is full (the router's bounds);
        the workers whose last record does are kept in `full`, so that the router looks
        at them alone, not at every worker, for each request."""
        self.model = model
        self.cap = cap
        self.max_batch = max_batch
        self.holders: dict[int, int] = {}
        #: One int for each set of holders: `holders` shares them, so a block has no int
        #: of its own (one bit at slot 999 takes 160 bytes), and `match` knows the same
        #: holders as the same object without reading it.
        self._sets: dict[int, int] = {}
        self._sets_limit = SETS_SLACK
        self.workers: dict[str, WorkerKv] = {}
        self.full: set[str] = set()
        self._full = full
        self._free: list[int] = []
        self._by_slot: list[str] = []  # slot -> address ("" when free)
        #: Tokens per block, from the first worker's events (0: none yet).
        self.block_size = 0
        self.batches = 0

    # -- membership --------------------------------------------------------------------

    def worker(self, address: str) -> WorkerKv:
        """The worker's entry, made on its first batch."""
        kv = self.workers.get(address)
        if kv is None:
            if self._free:
                slot = self._free.pop()
                self._by_slot[slot] = address
            else:
                slot = len(self._by_slot)
                self._by_slot.append(address)
            kv = self.workers[address] = WorkerKv(address, slot)
        return kv

    def drop(self, address: str) -> None:
        """Forgets the worker (it left, restarted, or its events stopped)."""
        kv = self.workers.pop(address, None)
        if kv is None:
            return
        self._forget_blocks(kv)
        self.full.discard(address)
        self._free.append(kv.slot)
        self._by_slot[kv.slot] = ""
        self._prune_sets()

    def _forget_blocks(self, kv: WorkerKv, hashes: Iterable[int] | None = None) -> None:
        holders, keep, sets = self.holders, ~kv.bit, self._sets
        for ours in kv.blocks.values() if hashes is None else hashes:
            bits = holders.get(ours, 0) & keep
            if bits:
                holders[ours] = sets.setdefault(bits, bits)
            else:
                holders.pop(ours, None)
        if hashes is None:
            kv.blocks = {}

    def _prune_sets(self) -> None:
        """Forgets the sets of holders that no block has any more, once there are more
        than twice those kept plus a quarter of the blocks: at most a quarter of an int a
        block is garbage, and the pass over the blocks comes once in a quarter of them."""
        if len(self._sets) > self._sets_limit:
            self._sets = {bits: bits for bits in self.holders.values()}
            self._sets_limit = 2 * len(self._sets) + len(self.holders) // 4 + SETS_SLACK

    # -- events ------------------------------------------------------------------------

    def apply(self, address: str, batch: KvBatch, now: float | None = None) -> bool:
        """Applies one batch of the worker's events; False when it was refused whole
        (too big), after which the worker's part is empty until new stores arrive."""
        now = time.monotonic() if now is None else now
        kv = self.worker(address)
        self.batches += 1
        kv.events_at = now
        if batch.timestamp:
            kv.lag = max(0.0, time.time() - batch.timestamp)
        load = batch.load
        if load is not None:
            if not 0.0 <= load.kv_usage <= 1.0:  # NaN, or out of range: no use to a cost
                load = load._replace(kv_usage=0.0 if math.isnan(load.kv_usage) else 1.0)
            kv.load, kv.load_at = load, now
            if self._full is not None and self._full(load):
                self.full.add(address)
            else:
                self.full.discard(address)
        if batch.sequence <= kv.sequence and not batch.reset:
            if batch.events:
                self._warn(kv, f"batch {batch.sequence} after {kv.sequence}: ignored", now)
            return True
        if batch.reset or (kv.sequence >= 0 and batch.sequence != kv.sequence + 1):
            if not batch.reset:
                self._warn(kv, f"events {kv.sequence + 1}..{batch.sequence - 1} lost", now)
            self._reset(kv)
        kv.sequence = batch.sequence
        size = sum(len(e.block_hashes) for e in batch.events if not isinstance(e, CacheCleared))
        if size > self.max_batch:
            self._warn(kv, f"a batch of {size} blocks (over {self.max_batch}): refused", now)
            self._reset(kv)
            return False
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self._stored(kv, event, now)
            elif isinstance(event, BlocksRemoved):
                self._removed(kv, event)
            else:
                self._reset(kv)
        if len(kv.blocks) > self.cap:
            self._evict(kv)
        self._prune_sets()
        return True

    def _reset(self, kv: WorkerKv) -> None:
        kv.resets += 1
        self._forget_blocks(kv)

    def _stored(self, kv: WorkerKv, event: BlocksStored, now: float) -> None:
        size, hashes, tokens = event.block_size, event.block_hashes, event.token_ids
        if size <= 0 or len(tokens) != size * len(hashes):
            self._warn(kv, f"{len(tokens)} tokens for {len(hashes)} blocks of {size}", now)
            return
        if size != self.block_size:
            if any(w.blocks for w in self.workers.values()):  # one size a model
                self._warn(kv, f"blocks of {size} tokens, not {self.block_size}: ignored", now)
                return
            self.block_size = size
        kv.block_size = size
        if event.parent is None:
            parent = ROOT
        else:
            found = kv.blocks.get(event.parent)
            if found is None:  # its parent was evicted here or never seen: unnameable
                kv.refused += 1
                return
            parent = found
        holders, bit, blocks, sets = self.holders, kv.bit, kv.blocks, self._sets
        for engine_hash, ours in zip(hashes, chain(tokens, size, parent), strict=True):
            blocks[engine_hash] = ours
            bits = holders.get(ours, 0) | bit
            holders[ours] = sets.setdefault(bits, bits)

    def _removed(self, kv: WorkerKv, event: BlocksRemoved) -> None:
        blocks = kv.blocks
        gone = [ours for h in event.block_hashes if (ours := blocks.pop(h, None)) is not None]
        self._forget_blocks(kv, gone)

    def _evict(self, kv: WorkerKv) -> None:
        """Forgets the worker's oldest eighth (an engine evicts its LRU blocks first)."""
        count = len(kv.blocks) - self.cap + self.cap // 8
        oldest = list(islice(kv.blocks, count))
        self._forget_blocks(kv, [kv.blocks.pop(h) for h in oldest])
        kv.evicted += len(oldest)

    def _warn(self, kv: WorkerKv, what: str, now: float) -> None:
        kv.refused += 1
        if now - kv.warned_at >= WARN_EVERY:
            kv.warned_at = now
            log.warning("model %s: KV events of worker %s: %s", self.model, kv.address, what)

    # -- reading -----------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> tuple[dict[str, int], int | None]:
        """Blocks of the request's chain each worker holds from its start (for the
        workers holding at least its first block), and the walk's last block: the
        prompt's first block that no worker holds with all before it, else its last
        (None for a prompt shorter than a block).

        `walk` hashes the chain as `chain` names blocks, only as far as some worker holds
        the prefix, whatever the number of workers: a new prompt costs one block."""
        size = self.block_size
        if not size or len(tokens) < size:
            return {}, None
        groups, ours = walk(tokens, size, self.holders)
        found: dict[str, int] = {}
        by_slot = self._by_slot
        for bits, held in groups:
            while bits:
                low = bits & -bits
                bits ^= low
                found[by_slot[low.bit_length() - 1]] = held
        return found, ours

    def memory_bytes(self) -> int:
        """An estimate of the index's memory (dict slots and the ints they hold)."""
        pairs = sum(len(kv.blocks) for kv in self.workers.values())
        shared = len(self.holders) + len(self._sets)
        return pairs * 2 * 48 + pairs * 2 * 36 + shared * (48 + 36)
