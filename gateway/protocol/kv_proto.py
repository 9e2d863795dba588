"""Our KV-cache event batches (`kv_blocks`) to the worker protocol's `KvEventBatch` and
back: the worker SDK sends them, the gateway's upstream reads them. Kept apart from
`convert.py` because only the scheduler's path uses them, once a batch, not a token."""

from __future__ import annotations

from gateway.protocol.kv_blocks import (
    BlocksRemoved,
    BlocksStored,
    EngineLoad,
    KvBatch,
    KvEvent,
)
from gateway.protocol.v1 import engine_pb2 as pb


def batch_to_proto(batch: KvBatch) -> pb.KvEventBatch:
    """One batch as the worker sends it (a cleared cache is a `reset` batch)."""
    message = pb.KvEventBatch(sequence=batch.sequence, reset=batch.reset, timestamp=batch.timestamp)
    for event in batch.events:
        if isinstance(event, BlocksStored):
            stored = pb.KvBlocksStored(
                block_hashes=event.block_hashes,
                token_ids=event.token_ids,
                block_size=event.block_size,
            )
            if event.parent is not None:
                stored.parent_block_hash = event.parent
            message.events.add(stored=stored)
        elif isinstance(event, BlocksRemoved):
            message.events.add(removed=pb.KvBlocksRemoved(block_hashes=event.block_hashes))
        else:
            message.reset = True  # a clear drops what came before it in the batch too
            del message.events[:]
    if batch.load is not None:
        load = batch.load
        message.load.CopyFrom(
            pb.EngineLoad(
                running=load.running,
                waiting=load.waiting,
                waiting_uncached_tokens=load.waiting_uncached_tokens,
                kv_usage=load.kv_usage,
            )
        )
    return message


def batch_from_proto(message: pb.KvEventBatch) -> KvBatch:
    """A worker's batch as the index applies it."""
    events: list[KvEvent] = []
    for event in message.events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            stored = event.stored
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            events.append(
                BlocksStored(
                    tuple(stored.block_hashes), parent, stored.token_ids, stored.block_size
                )
            )
        elif kind == "removed":
            events.append(BlocksRemoved(tuple(event.removed.block_hashes)))
    load = None
    if message.HasField("load"):
        raw = message.load
        load = EngineLoad(raw.running, raw.waiting, raw.waiting_uncached_tokens, raw.kv_usage)
    return KvBatch(message.sequence, tuple(events), message.reset, load, message.timestamp)
