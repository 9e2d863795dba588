"""Whether a worker fits where the config puts it, from what it says of itself (its
`describe`: the models it serves; for vLLM's gRPC servers `GetServerInfo`'s KV
connector, its role and data-parallel engines; for vLLM's OpenAI servers the engines their
`/metrics` samples). A worker that does not fit is kept out of the
rotation, logged once, its `Worker.misfit` saying why: its state for operators
(`/admin/workers`) and metrics (`worker_healthy{state}`). Nothing it does not say is
checked."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.data_parallel import split
from gateway.upstreams.base import ModelDescription

if TYPE_CHECKING:
    from gateway.fleet.pool import ModelPool

#: It serves other models than the one it is listed for.
WRONG_MODEL = "wrong_model"
#: A split model's worker (`prefill_workers`) whose engine has no KV connector: as a
#: prefill worker its answers would carry no blocks' whereabouts, as a decode worker it
#: would prefill again and leave the prefill server holding the blocks until vLLM's abort
#: timeout.
NO_KV_CONNECTOR = "no_kv_connector"
#: A split model's worker whose engine's KV connector has the other tier's role (vLLM's
#: `kv_role`): a prefill worker that is `kv_consumer`, a decode worker that is
#: `kv_producer` (vLLM asks for `kv_producer` on prefill servers and `kv_consumer` on
#: decode servers; its connectors and scheduler act on the role, e.g. Mooncake's only
#: send from a producer and only receive on a consumer).
WRONG_KV_ROLE = "wrong_kv_role"
#: The role each tier needs, and the one that does not fit it.
_TIER_ROLES = {"prefill": ("kv_producer", "kv_consumer"), "decode": ("kv_consumer", "kv_producer")}
#: An engine (`ADDRESS#dpI`, `data_parallel_size`) past those its server runs: its server
#: runs I or fewer (the I-th of its own: under vLLM's hybrid load balancing, a server of
#: ranks 8 to 15 serves `#dp0` to `#dp7`, `base.engine_rank`).
NO_SUCH_ENGINE = "no_such_engine"


def misfit(
    pool: ModelPool, address: str, served: dict[str, int], mine: ModelDescription | None
) -> tuple[str, str] | None:
    """Why the worker at `address` does not fit `pool` (its state, and a sentence for the
    log), or None; `served`: what it serves, `mine`: its description of the pool's model."""
    if mine is None:
        models = ", ".join(sorted(served)) or "nothing"
        return WRONG_MODEL, f"worker {address} serves {models}, not {pool.name}"
    tier = pool.kv_tier
    if tier is not None and mine.kv_connector == "":
        return NO_KV_CONNECTOR, (
            f"worker {address} of {pool.name} has no KV connector (vLLM's "
            "--kv-transfer-config), which prefill/decode disaggregation needs"
        )
    if tier is not None and mine.kv_role == _TIER_ROLES[tier][1]:
        needed = _TIER_ROLES[tier][0]
        return WRONG_KV_ROLE, (
            f"{tier} worker {address} of {pool.name} has a KV connector of role "
            f"{mine.kv_role} (vLLM's --kv-transfer-config kv_role): a {tier} worker "
            f"{'hands KV blocks on' if tier == 'prefill' else 'takes KV blocks'}, "
            f"which needs {needed} or kv_both"
        )
    engines, (_, index) = mine.engine_ranks, split(address)
    if engines is not None and index is not None and index >= len(engines):
        return NO_SUCH_ENGINE, (
            f"worker {address} of {pool.name}: its server runs {_described(engines)}, "
            f"not {pool.data_parallel_size} (models[].data_parallel_size)"
        )
    return None


def idle_engines(pool: ModelPool, address: str, mine: ModelDescription | None) -> str | None:
    """A sentence for the log when the server at `address` runs more data-parallel engines
    than the config gives it (some never get a request, or its own balancing places
    requests the routing meant for one cache), said for its first engine only; else None."""
    engines = None if mine is None else mine.engine_ranks
    server, rank = split(address)
    if engines is None or rank not in (None, 0) or len(engines) <= pool.data_parallel_size:
        return None
    if pool.data_parallel_size == 1:
        return (
            f"worker {server} of {pool.name} runs {_described(engines)}, routed as "
            "one worker: set models[].data_parallel_size to route each on its own cache"
        )
    return (
        f"worker {server} of {pool.name} runs {_described(engines)}, "
        f"models[].data_parallel_size {pool.data_parallel_size}: the others get no request"
    )


def _described(ranks: tuple[int, ...]) -> str:
    """A server's engines in words: "2 data-parallel engines", and their ranks where they
    are not 0 to N-1 (a server of external or hybrid load balancing)."""
    words = f"{len(ranks)} data-parallel engine{'s' if len(ranks) != 1 else ''}"
    if ranks == tuple(range(len(ranks))):
        return words
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"{words} (ranks {shown})"
