"""A vLLM server's data-parallel engines as workers of their own (`models[].data_parallel_size`).

A server started with `--data-parallel-size N` runs N engines behind one address, each
with its own KV cache and queue, and balances requests over them itself, by their loads:
a prompt whose prefix one engine holds lands on any of them. So, as smg's DP-aware
routing does, each engine is a worker here, `ADDRESS#dpI` (I from 0), on an upstream
that pins every request to its server's I-th engine (vLLM's `X-data-parallel-rank`
header on its OpenAI server, `data_parallel_rank` on its gRPC server: an index among
the server's own engines), followed apart by its rank R (the I-th of the ranks its
server says it runs, `base.engine_rank`: I itself, but on a server of vLLM's hybrid load
balancing, which runs a slice of a larger group, 8 to 15 on a second node): its KV events
(a ZMQ publisher binds rank R's socket on the configured port + R, as vLLM offsets it;
the gRPC relay tags each batch with its rank), its load (the `engine="R"` samples of
`/metrics`; the relay's load records of rank R), its health (the server's). Routing
then sees N caches and sends a prompt to the engine holding its prefix.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from gateway.upstreams.base import RANK_MARK, engine_address

if TYPE_CHECKING:
    from gateway.fleet.worker import Worker


def engines(addresses: Iterable[str], size: int) -> list[str]:
    """The workers of servers at `addresses` with `size` engines each (the addresses
    themselves when `size` is 1)."""
    if size == 1:
        return list(addresses)
    return [engine_address(address, rank) for address in addresses for rank in range(size)]


def split(address: str) -> tuple[str, int | None]:
    """A worker's server address and its engine's index there (None: a server's own
    address)."""
    server, mark, index = address.rpartition(RANK_MARK)
    if not mark or not index.isdigit():
        return address, None
    return server, int(index)


def engine_rank_of(worker: Worker) -> int | None:
    """The data-parallel rank its server says the worker's engine runs (the upstream's
    `engine_rank`, learnt when it describes itself: past its index under hybrid load
    balancing); None for a whole server's worker, for an upstream without ranks, and
    before its rank is known (read through `getattr`: not every upstream has one)."""
    rank = getattr(worker.upstream, "engine_rank", None)
    return rank if isinstance(rank, int) else None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where rank `rank` of a vLLM server publishes what its rank 0 publishes at
    `endpoint` (a `tcp://host:port` ZMQ address): the port plus the rank."""
    parts = urlsplit(endpoint)
    if rank == 0 or parts.port is None:
        return endpoint
    host = parts.netloc.rpartition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port + rank}"))


def rank_shift(address: str, rank: int | None) -> int:
    """How many ports past the one `rank_entries` gave the worker at `address` its
    engine of rank `rank` publishes: its rank past its index (hybrid load balancing),
    else 0."""
    _, index = split(address)
    return 0 if index is None or rank is None else rank - index


def rank_entries(entries: Iterable[tuple[str, str]], size: int) -> tuple[tuple[str, str], ...]:
    """`routing.kv_events` (or `kv_replay`) of servers with `size` engines each: one
    entry an engine, at its own port."""
    if size == 1:
        return tuple(entries)
    return tuple(
        (worker, rank_endpoint(endpoint, rank))
        for server, endpoint in entries
        for rank, worker in enumerate(engines((server,), size))
    )
