"""KV-cache blocks as the gateway names them, and the events engines send about them.

An engine's prefix cache holds a prompt's tokens in fixed-size blocks, each named by a
hash of its tokens and of the block before it (a chain: a block's hash names its whole
prefix). Engines hash with their own algorithm and seed (vLLM's differs from SGLang's,
and from one process to the next unless PYTHONHASHSEED is set), so the gateway names a
block itself, from the token ids the events carry: `chain` over tuples of ints, whose
`hash` is the same in every process of one Python version (ints hash to themselves;
only str and bytes hashes are salted), so two gateway replicas name every block alike.
A 64-bit chain collides once in ~2^32 blocks of one worker: a wrong cache hit at worst.

Token ids: an engine's own for `vllm-grpc` workers (the gateway tokenizes for them); the
UTF-8 bytes of the prompt as `prompt_bytes` renders it for every other kind (the text
fallback), which the demo engine's cache model uses too, so tests see the same blocks.

The events are ours, whatever their wire (vLLM's `SubscribeKvEvents`, our protocol's):
upstreams translate into them, `gateway.fleet.kv_index` applies them. Block hashes in
events are the engine's; only its removals need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gateway.protocol.types import GenerateRequest

#: The parent of a prompt's first block.
ROOT = 0


def chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The gateway's hashes of the full blocks of `tokens`, in order (a partial last
    block is not cached by engines, so it is not named). `KvIndex.match` hashes a
    request's blocks the same way as it walks, only as far as some worker holds them."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


def prompt_bytes(request: GenerateRequest, limit: int | None = None) -> bytes:
    """The prompt as tokens for the text fallback: its UTF-8 bytes, chat messages as
    role NUL content NUL each (the first `limit` bytes when given)."""
    if request.messages is None:
        data = (request.prompt or "").encode()
    else:
        data = b"".join(
            b"%s\x00%s\x00" % (m.role.encode(), m.content.encode()) for m in request.messages
        )
    return data if limit is None else data[:limit]


class BlocksStored(NamedTuple):
    """Consecutive blocks the engine now holds: its hashes of them (one per block), its
    hash of the block before the first (None: they start a prompt), and their tokens."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int


class BlocksRemoved(NamedTuple):
    """Blocks the engine dropped, by its own hashes."""

    block_hashes: tuple[int, ...]


class CacheCleared(NamedTuple):
    """The engine dropped every block."""


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


class EngineLoad(NamedTuple):
    """The engine's queue and occupancy, from its scheduler."""

    running: int = 0
    waiting: int = 0
    #: Prompt tokens of the waiting requests its cache does not hold.
    waiting_uncached_tokens: int = 0
    #: Fraction of its KV cache in use, 0 to 1.
    kv_usage: float = 0.0


class KvBatch(NamedTuple):
    """What an engine did since its previous batch: `sequence` is one more than that
    batch's (a gap means events were lost); `reset` says it forgot every block before
    `events` (a subscription's first batch, a snapshot); `load` when it changed."""

    sequence: int
    events: tuple[KvEvent, ...] = ()
    reset: bool = False
    load: EngineLoad | None = None
    #: When the engine sent it, seconds since the epoch (0: unknown), for the lag.
    timestamp: float = 0.0
