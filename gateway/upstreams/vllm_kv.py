"""vLLM's KV-cache events, as its gRPC server relays them (`SubscribeKvEvents`, smg-grpc-proto
`common.proto`: `KvEventBatch`), turned into ours (`gateway.protocol.kv_blocks`).

What the index can use, and only that: blocks stored on the engine's own device (a block
offloaded to host memory or disk, or one a remote pool holds, is not a prefix this worker
serves at GPU speed), of the base model with no cache salt (a LoRA adapter's or a salted
prompt's blocks hash under a namespace the gateway does not compute), their token ids and
the engine's hashes; removals; a cleared cache. The first batch of a subscription resets
what the gateway knew of the worker (it may have missed anything before it; a relay's
snapshot then lists every live block). The engine's load record rides on every batch
(`EngineLoad`: running, waiting, waiting uncached tokens, KV usage); a `load_only` batch
repeats the last sequence and carries no events, as our protocol's duplicates do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from smg_grpc_proto.generated import common_pb2 as common

from gateway.protocol.kv_blocks import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    KvEvent,
)

_DEVICE = (common.KV_CACHE_TIER_UNSPECIFIED, common.KV_CACHE_TIER_DEVICE)


def subscribe_request() -> common.SubscribeKvEventsRequest:
    """From the engine's current state, with load records before its first batch."""
    return common.SubscribeKvEventsRequest(
        start_sequence_number=0, load_records_before_first_batch=True
    )


def _local(message: common.KvBlocksStored | common.KvBlocksRemoved) -> bool:
    if message.HasField("tier") and message.tier not in _DEVICE:
        return False
    return not (
        message.HasField("locality") and message.locality == common.KV_CACHE_LOCALITY_REMOTE
    )


def _stored(message: common.KvBlocksStored) -> BlocksStored | None:
    if not _local(message) or message.lora_name or message.cache_salt or not message.blocks:
        return None
    blocks = message.blocks
    if any(b.extra_keys or b.HasField("lora_id") for b in blocks):
        return None  # hashed with inputs beyond the tokens (images, an adapter)
    size = blocks[0].block_size
    tokens = [t for block in blocks for t in block.token_ids]  # the index checks the count
    parent = message.parent_block_hash if message.HasField("parent_block_hash") else None
    return BlocksStored(tuple(b.block_hash for b in blocks), parent, tokens, size)


def batch_from_vllm(message: common.KvEventBatch, first: bool) -> KvBatch:
    """One relayed batch as the index applies it; `first`: the subscription's first."""
    events: list[KvEvent] = []
    for event in message.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = _stored(event.stored)
            if stored is not None:
                events.append(stored)
        elif kind == "removed":
            if _local(event.removed):
                events.append(BlocksRemoved(tuple(event.removed.block_hashes)))
        elif kind == "cleared":
            events.append(CacheCleared())
    load = None
    if message.HasField("load"):
        raw = message.load
        uncached = raw.waiting_uncached_tokens if raw.HasField("waiting_uncached_tokens") else 0
        load = EngineLoad(raw.running_requests, raw.waiting_requests, uncached, raw.token_usage)
    return KvBatch(message.sequence_number, tuple(events), first, load, message.timestamp)


#: Batches that may wait for one engine's follower (the index applies one in tens of µs;
#: past this the follower is stuck, and its batches are dropped: a gap, which the index
#: handles as a lost message).
FOLLOWER_QUEUE = 1024

#: What a follower's queue holds: a batch, the stream's failure, or None (its end).
_Item = common.KvEventBatch | BaseException | None


class RankedEvents:
    """One `SubscribeKvEvents` stream of a data-parallel vLLM server, read once for all of
    its engines (`models[].data_parallel_size`): the relay sends every rank's batches on
    it, each tagged `dp_rank`, and each is handed to the follower of its rank. Without
    it each engine's worker subscribed and dropped the other ranks' batches: N streams
    each carrying N ranks'. The stream opens with the first follower, closes with the
    last; when it ends or fails, every follower does too (and subscribes again)."""

    def __init__(self) -> None:
        self._followers: dict[int, asyncio.Queue[_Item]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def follow(
        self, rank: int, open_stream: Callable[[], AsyncIterator[common.KvEventBatch]]
    ) -> AsyncIterator[common.KvEventBatch]:
        """Rank `rank`'s batches, from the server's stream (opened by `open_stream` if none
        is open), until it ends; its failure raised here."""
        queue: asyncio.Queue[_Item] = asyncio.Queue(FOLLOWER_QUEUE)
        self._followers[rank] = queue  # a follower of the rank again: the newest one
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read(open_stream))
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self._followers.get(rank) is queue:
                del self._followers[rank]
            if not self._followers and self._reader is not None:
                self._reader.cancel()
                self._reader = None

    async def _read(self, open_stream: Callable[[], AsyncIterator[common.KvEventBatch]]) -> None:
        end: BaseException | None = None
        try:
            async for message in open_stream():
                queue = self._followers.get(message.dp_rank)
                if queue is not None and not queue.full():
                    queue.put_nowait(message)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the stream's failure, for every follower to raise
            end = error
        if self._reader is asyncio.current_task():
            self._reader = None
        for queue in self._followers.values():  # each ends, after what it has
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(end)
