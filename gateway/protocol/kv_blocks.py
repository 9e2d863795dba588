"""KV-cache blocks as the gateway names them, and the events engines send about them.

An engine's prefix cache holds a prompt's tokens in fixed-size blocks, each named by a
hash of its tokens and of the block before it (a chain: a block's hash names its whole
prefix). Engines hash with their own algorithm and seed (vLLM's differs from SGLang's,
and from one process to the next unless PYTHONHASHSEED is set), so the gateway names a
block itself, from the token ids the events carry: `chain` over tuples of ints, whose
`hash` is the same in every process of one Python version (ints hash to themselves;
only str and bytes hashes are salted), so two gateway replicas name every block alike.
A 64-bit chain collides once in ~2^32 blocks of one worker: a wrong cache hit at worst.

`chain` and `walk` run for every request the router scores and every block an engine
stores: `_kv_blocks.c` is them in C (a token a hash round, a block a dict lookup), built
with the package where a compiler is; the Python functions here are their definition, and
the fallback elsewhere (about 1 µs a block). Both give the same names to the bit, so
replicas built either way agree.

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


def _chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The gateway's hashes of the full blocks of `tokens`, in order (a partial last
    block is not cached by engines, so it is not named)."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        hashes.append(parent)
    return hashes


def _walk(
    tokens: Sequence[int], block_size: int, holders: dict[int, int]
) -> tuple[list[tuple[int, int]], int | None]:
    """Follows the request's chain through `holders` (a block's name -> the bits of the
    workers holding it) only as far as some worker holds it with all before it, hashing
    each block as `chain` does: a new prompt costs one block. Returns the groups of
    workers that stop holding it together, as (their bits, blocks they hold), and the
    walk's last name (None when the prompt is shorter than a block).

    Where the holders do not change the step is a dict lookup (the same holders are the
    same int object: `KvIndex` shares them); where they do, a big-int AND, whatever the
    number of workers."""
    groups: list[tuple[int, int]] = []
    ours: int | None = None
    name, alive = ROOT, -1  # alive -1: every worker, before the first block
    for depth, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        ours = name = hash((name, tuple(tokens[start : start + block_size])))  # as `chain`
        bits = holders.get(name, 0)
        if bits is not alive:
            common = bits & alive
            if common != alive:
                if depth:
                    groups.append((alive & ~common, depth))
                if not common:
                    return groups, ours
                alive = bits if common == bits else common
    if ours is not None:
        groups.append((alive, len(tokens) // block_size))
    return groups, ours


try:  # the same two functions in C, where the package was built with a compiler
    from gateway.protocol._kv_blocks import chain as chain
    from gateway.protocol._kv_blocks import walk as walk
except ImportError:  # pragma: no cover - an install without a compiler
    chain, walk = _chain, _walk


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
