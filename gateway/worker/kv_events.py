"""An engine's KV-cache events on the worker protocol (`SubscribeKvEvents`), and the
cache model the demo engine publishes them from.

`KvPublisher` fans an engine's batches out to every subscriber (each gateway replica
subscribes on its own). A subscription starts with a `reset` batch listing every block
the engine holds (its `snapshot`), numbered 1, then the live batches in order, each one
more; a subscriber that reads too slowly to keep `QUEUE_BATCHES` batches is cut off
(its stream ends with RESOURCE_EXHAUSTED) rather than growing the worker's memory, and
starts again from a fresh snapshot when it subscribes again.

`ForwardedCache` republishes an engine's own event stream (the vLLM engine's ZMQ
publisher, read with `gateway.protocol.kv_zmq`), keeping its blocks for the snapshot.

`LruBlockCache` is the demo engine's prefix cache: a prompt's tokens (its UTF-8 bytes,
`gateway.protocol.kv_blocks.prompt_bytes`, as the gateway's text fallback names them) in
blocks of `block_size`, the least recently used dropped past `capacity` blocks, like an
engine's block pool. It names blocks with a hash salted per process, as vLLM does, so
the gateway's own hash chain is what makes two workers' blocks comparable.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from gateway.protocol.kv_blocks import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    KvEvent,
)

#: Batches a subscriber may have waiting before it is cut off.
QUEUE_BATCHES = 1024


class SubscriberTooSlow(Exception):
    """A subscriber fell `QUEUE_BATCHES` behind; the worker ends its stream."""


class KvPublisher:
    """Sends an engine's KV batches to its subscribers; `snapshot` gives its blocks now."""

    def __init__(self, snapshot: Callable[[], tuple[KvEvent, ...]]) -> None:
        self._snapshot = snapshot
        self._queues: set[asyncio.Queue[tuple[tuple[KvEvent, ...], EngineLoad | None]]] = set()

    @property
    def subscribers(self) -> int:
        """Subscriptions open now (the engine skips its bookkeeping while 0)."""
        return len(self._queues)

    def publish(self, events: tuple[KvEvent, ...], load: EngineLoad | None = None) -> None:
        """Queues one batch for every subscriber (never blocks the engine)."""
        for queue in self._queues:
            if not queue.full():  # a full one's reader ends its stream at once
                queue.put_nowait((events, load))

    async def subscribe(self, load: EngineLoad | None = None) -> AsyncIterator[KvBatch]:
        """The snapshot as a reset batch, then the live batches, until cancelled."""
        queue: asyncio.Queue[tuple[tuple[KvEvent, ...], EngineLoad | None]] = asyncio.Queue(
            QUEUE_BATCHES
        )
        self._queues.add(queue)
        try:
            sequence = 1
            yield KvBatch(sequence, self._snapshot(), True, load, time.time())
            while True:
                if queue.full():
                    raise SubscriberTooSlow(f"{QUEUE_BATCHES} batches behind")
                events, batch_load = await queue.get()
                sequence += 1
                yield KvBatch(sequence, events, False, batch_load, time.time())
        finally:
            self._queues.discard(queue)


def snapshot_of(
    blocks: Mapping[int, tuple[int | None, Sequence[int]]], block_size: int
) -> tuple[KvEvent, ...]:
    """Blocks {engine hash: (parent hash or None, tokens)} as one stored event each,
    parents before children (a subscriber names a block only after its parent)."""
    depth: dict[int, int] = {}
    for h in blocks:
        path: list[int] = []
        p: int | None = h
        while p is not None and p in blocks and p not in depth:
            path.append(p)
            p = blocks[p][0]
        base = depth[p] + 1 if p is not None and p in depth else 0
        for q in reversed(path):
            depth[q] = base
            base += 1
    return tuple(
        BlocksStored((h,), blocks[h][0], blocks[h][1], block_size)
        for h in sorted(blocks, key=depth.__getitem__)
    )


class ForwardedCache:
    """An engine's blocks as its own event stream tells them (vLLM's ZMQ publisher,
    `gateway.protocol.kv_zmq`), republished on our protocol: `apply` each batch.

    Kept so a gateway that subscribes later gets them as its snapshot, which vLLM's
    publisher never sends. A batch after a gap, or from a restarted publisher, clears
    what was kept (it may be wrong now) and tells the subscribers so (a cleared
    cache: they drop this worker's part and follow the live events from there). At
    most `capacity` blocks are kept, the oldest forgotten first (and announced as
    removed, so every subscriber forgets them too).
    """

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity
        self.block_size = 0
        #: engine hash -> (parent engine hash or None, tokens), oldest first.
        self.blocks: OrderedDict[int, tuple[int | None, Sequence[int]]] = OrderedDict()
        self.publisher = KvPublisher(self.snapshot)
        self._sequence: int | None = None

    def snapshot(self) -> tuple[KvEvent, ...]:
        """Every block kept, parents before children."""
        return snapshot_of(self.blocks, self.block_size)

    def apply(self, batch: KvBatch, load: EngineLoad | None = None) -> None:
        """One batch of the engine's stream: kept, and published with `load`."""
        events: list[KvEvent] = list(batch.events)
        last, self._sequence = self._sequence, batch.sequence
        if (batch.reset or last is None or batch.sequence != last + 1) and self.blocks:
            events.insert(0, CacheCleared())
        blocks = self.blocks
        for event in events:
            if isinstance(event, BlocksStored):
                size, parent = event.block_size, event.parent
                if size != self.block_size and blocks:
                    continue  # one size an engine (the index refuses others too)
                self.block_size = size
                for i, h in enumerate(event.block_hashes):
                    blocks[h] = (parent, event.token_ids[i * size : (i + 1) * size])
                    parent = h
            elif isinstance(event, BlocksRemoved):
                for h in event.block_hashes:
                    blocks.pop(h, None)
            else:
                blocks.clear()
        if len(blocks) > self.capacity:
            oldest = [blocks.popitem(last=False)[0] for _ in range(len(blocks) - self.capacity)]
            events.append(BlocksRemoved(tuple(oldest)))
        if self.publisher.subscribers and (events or load is not None):
            self.publisher.publish(tuple(events), load)


def _engine_hash(salt: bytes, parent: int, tokens: bytes) -> int:
    digest = hashlib.blake2b(salt + parent.to_bytes(8, "big", signed=True) + tokens, digest_size=8)
    return int.from_bytes(digest.digest(), "big", signed=True)


class LruBlockCache:
    """A prefix cache of `capacity` blocks of `block_size` tokens (bytes), LRU."""

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._salt = secrets.token_bytes(8)
        #: engine hash -> (parent engine hash or None, tokens), least recently used first.
        self.blocks: OrderedDict[int, tuple[int | None, bytes]] = OrderedDict()
        self.publisher = KvPublisher(self.snapshot)

    @property
    def usage(self) -> float:
        """Fraction of the cache in use."""
        return len(self.blocks) / self.capacity if self.capacity else 0.0

    def snapshot(self) -> tuple[KvEvent, ...]:
        """Every block held, one event each, parents before children."""
        return snapshot_of(self.blocks, self.block_size)

    def admit(self, tokens: Sequence[int] | bytes, load: EngineLoad | None = None) -> int:
        """Runs a prompt through the cache: returns the blocks it held from the start,
        stores the rest, evicts past capacity (the chain's tail first, as an engine frees
        a request's blocks), and publishes what changed."""
        data = bytes(tokens)
        size, blocks = self.block_size, self.blocks
        parent: int | None = None
        hit, hitting = 0, True
        path: list[int] = []
        runs: list[tuple[int | None, list[int], list[bytes]]] = []  # stored, contiguous
        run: tuple[int | None, list[int], list[bytes]] | None = None
        for start in range(0, len(data) - size + 1, size):
            chunk = data[start : start + size]
            h = _engine_hash(self._salt, 0 if parent is None else parent, chunk)
            if h in blocks:
                hit += hitting
                run = None
            else:
                hitting = False
                blocks[h] = (parent, chunk)
                if run is None:
                    run = (parent, [], [])
                    runs.append(run)
                run[1].append(h)
                run[2].append(chunk)
            path.append(h)
            parent = h
        for h in reversed(path):  # the prompt's start is the most recently used
            blocks.move_to_end(h)
        events: list[KvEvent] = [
            BlocksStored(tuple(hashes), first, b"".join(chunks), size)
            for first, hashes, chunks in runs
        ]
        removed: list[int] = []
        while len(blocks) > self.capacity:
            removed.append(blocks.popitem(last=False)[0])
        if removed:
            events.append(BlocksRemoved(tuple(removed)))
        if self.publisher.subscribers and (events or load is not None):
            self.publisher.publish(tuple(events), load)
        return hit
