"""Routing on what the engines hold and what they have queued (`models[].routing`).

`Router` is a model's balancer when its entry has `routing:`. Its policies:

- `kv_aware`: the worker with the lowest expected cost, in prompt tokens of work, of
  starting the request now:

      cost = prefill_weight * (prompt tokens - tokens of its longest prefix the worker holds)
           + queue_weight   * waiting uncached tokens (its engine's last load record)
           + running_cost   * max(requests it runs, this gateway's calls to it)
           + usage_cost     * its KV-cache use (0 to 1)

  as NVIDIA Dynamo's KV router (prefill blocks to do plus decode load) and llm-d's
  precise prefix-cache scorer weigh them. The engine's terms read its last load record
  only while it is fresh (`LOAD_FRESH`, as for shedding): an idle engine sends none, so
  past that its last, busy one no longer costs it (its requests: this gateway's calls
  to it). The defaults count a running request as 64
  prompt tokens (one decode step of a batch costs about as much as a short prefill
  chunk) and a full cache as 256 (eviction ahead). The cached prefix comes from
  `KvIndex.match` over the request's chain (`gateway.protocol.kv_blocks`): the token
  ids the gateway encodes for `vllm-grpc` workers (`prompt_ids`), or by the model's
  `tokenizer` when it has one (vLLM's HTTP servers over ZMQ, our workers on
  `--engine vllm`: their engines name blocks by ids, as vLLM's front end encodes;
  `routing_ids`, which reuses the encoded pieces of a conversation's earlier turns),
  else the prompt's bytes (the text fallback, as the demo engine caches). Ties (within
  one block of prefill) go to the worker with fewer calls in flight, then at random,
  so equal workers share the load instead of herding on the first.
- `least_load`: the same cost without the cache term.
- `prefix`: today's `prefix_affinity` (consistent hashing of the prompt's start).
- `round_robin`: each worker in turn.

A model none of whose candidates publishes events (no `SubscribeKvEvents`, or its
stream broken) falls back to `prefix_affinity` for `kv_aware` and to power of two
choices for `least_load`, and the decision says so (`fallback`), as do the metrics
and `/admin/workers` per worker.

Session affinity: a request with a session (`GenerateRequest.session`, from
`x-session-id` or a route's own key, else the OpenAI `user`) goes to the worker its
session used last while that worker is available and has at most
`session_load_factor` times the average calls in flight (plus one): past that the
session is routed as a new one and follows its new worker, so one hot session cannot
pin an overloaded worker. At most `max_sessions` are remembered, oldest forgotten.

Cost per request, whatever the fleet's size: the chain as far as some worker holds it
(`KvIndex.match`: a hash and a dict lookup a block), and the cost of each candidate
that can still win; past `SAMPLE_ABOVE` candidates only the holders (by address, from the
walk) and `SAMPLED` others are costed, and shedding looks only at the engines that said
they are full (`KvIndex.full`). `benchmarks/sim_routing.py` has the curve: 10-13 µs a new
8,000-token prompt at 10 to 1,000 workers on a shared 2-core VM, 26-32 µs one held whole
(about 40 ns a held block with the C walk, 0.35 µs without it).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache, partial
from typing import NamedTuple

from gateway.config import RoutingConfig
from gateway.fleet.balancing import (
    LeastOutstanding,
    PrefixAffinity,
    Roster,
    outstanding,
    stable_hash,
)
from gateway.fleet.kv_index import KvIndex, WorkerKv
from gateway.fleet.worker import Worker
from gateway.protocol import errors
from gateway.protocol.kv_blocks import EngineLoad, prompt_bytes
from gateway.protocol.kv_zmq import ZmqKvSubscriber
from gateway.protocol.types import GenerateRequest
from gateway.tokenization import load_tokenizer
from gateway.upstreams.vllm_grpc import MAX_PROMPT_CHARS, prompt_chars

#: Past this many candidates, those holding none of the prompt are scored on a random
#: `SAMPLED` of them (power of d choices) rather than all: a worker holding nothing
#: differs from another only by its load, and the sample spreads it.
SAMPLE_ABOVE = 32
SAMPLED = 8
#: Bytes of a prompt the text fallback hashes at most (a 32k-token prompt's worth).
TEXT_LIMIT = 128 * 1024
#: Seconds a load record counts, for the cost and for `engine_full` (an engine sends one
#: a scheduler step while it works; an idle one sends none, and its last record, busy, is
#: no longer true).
LOAD_FRESH = 10.0


class Route(NamedTuple):
    """Why a worker was picked, for the access log and the trace."""

    policy: str
    #: Blocks of the request's prefix the picked worker holds (kv_aware), else 0.
    cache_hit_blocks: int = 0
    #: "session": kept on its session's worker; "fallback": no events to route on.
    reason: str = ""


_MASK = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _address_hash(address: str) -> int:
    return stable_hash(address)


def _rendezvous(anchor: int, address: str) -> float:
    """The worker's weight for a prompt whose new content starts at block `anchor`
    (highest random weight hashing: the same on every replica, and only the prompts
    of a worker that leaves move): splitmix64 of the two hashes, in [0, 1)."""
    x = (anchor ^ _address_hash(address)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) / 2.0**64


def _fresh(kv: WorkerKv | None, now: float) -> EngineLoad | None:
    """The worker's last load record while it is fresh (`LOAD_FRESH`), else None."""
    if kv is None or kv.load is None or now - kv.load_at > LOAD_FRESH:
        return None
    return kv.load


def _text_tokens(request: GenerateRequest) -> Sequence[int]:
    return prompt_bytes(request, TEXT_LIMIT)


class Router:
    """A model's balancer under `routing:`; `last` is the reason of the latest pick."""

    def __init__(
        self,
        model: str,
        config: RoutingConfig,
        prefix: PrefixAffinity,
        rng: random.Random | None = None,
        tokenizer: str | None = None,
    ) -> None:
        """`tokenizer`: the model's, when it has one: its workers' engines name blocks
        by token ids (vLLM's, over ZMQ or through our worker), so the prompt is hashed
        as ids, not as text."""
        self.config = config
        self._tokenizer = load_tokenizer(tokenizer) if tokenizer else None
        self.policy = config.policy
        self.index = KvIndex(
            model, cap=config.max_blocks_per_worker, full=self._over if self.sheds else None
        )
        self._encoded: tuple[GenerateRequest, Sequence[int]] | None = None
        self._prefix = prefix
        self._p2c = LeastOutstanding(rng)
        self._rng = rng or random.Random()
        self._turn = itertools.count()
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self._members: list[Worker] = []  # the latest candidates, and by address
        self._by_address: dict[str, Worker] = {}
        self.last = Route(self.policy)
        self.fallbacks_total = 0
        self.session_moves_total = 0
        #: Per worker address: its event stream's state (`kv_follow`), and the worker
        #: object whose follower owns its part of the index.
        self.states: dict[str, str] = {}
        self.owners: dict[str, Worker] = {}
        #: Per `upstream: openai` worker address: its `/metrics` read's state
        #: (`kv_follow.follow_loads`: loads, unsupported, broken).
        self.scrapes: dict[str, str] = {}
        #: Workers whose engine publishes over ZMQ: address -> its publisher's and its
        #: replay socket's endpoints as configured, and its subscriber.
        replay = dict(config.kv_replay)
        self.zmq_endpoints = {
            entry: (endpoint, replay.get(entry)) for entry, endpoint in config.kv_events
        }
        self.zmq = {entry: ZmqKvSubscriber(*at) for entry, at in self.zmq_endpoints.items()}

    @property
    def uses_events(self) -> bool:
        """Whether this policy reads the engines' events (its workers are subscribed)."""
        return self.policy in ("kv_aware", "least_load")

    async def prepare(self, request: GenerateRequest, workers: Iterable[Worker]) -> None:
        """Encodes the prompt before `pick` where the model's workers take token ids
        (`vllm-grpc`: the upstream's `routing_ids`, off the event loop, kept for the
        call); nothing for other kinds or policies, or before any event arrived."""
        self._encoded = None
        if self.policy != "kv_aware" or not self.index.block_size:
            return
        encode = next((getattr(w.upstream, "routing_ids", None) for w in workers), None)
        if encode is None and self._tokenizer is not None:
            encode = self._token_ids
        if encode is None:
            return
        try:
            self._encoded = (request, await encode(request))
        except errors.GatewayError:
            return  # the call refuses it (too long, ...) with the same error

    async def _token_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's ids as vLLM's OpenAI front end makes them (a completion's text
        with the special tokens, a chat through the template), off the loop; none past
        `MAX_PROMPT_CHARS` (the engine refuses such a prompt on its own)."""
        assert self._tokenizer is not None
        tools = request.tools if request.tool_choice != "none" else ()
        if prompt_chars(request.prompt, request.messages, tools) > MAX_PROMPT_CHARS:
            raise errors.Invalid("The prompt is too long to route by its tokens.")
        make = partial(self._tokenizer.routing_ids, request.prompt, request.messages, tools)
        return await asyncio.to_thread(make)

    def pick(self, candidates: list[Worker], request: GenerateRequest) -> Worker:
        """The worker for `request` (candidates is never empty); sets `last`."""
        session = request.session or request.user
        if session:
            kept = self._session_worker(session, candidates)
            if kept is not None:
                self.last = Route(self.policy, 0, "session")
                return kept
        worker = self._pick(candidates, request)
        if session:
            self._remember(session, worker.address)
        return worker

    def _pick(self, candidates: list[Worker], request: GenerateRequest) -> Worker:
        policy = self.policy
        if policy == "round_robin":
            self.last = Route(policy)
            return candidates[next(self._turn) % len(candidates)]
        if policy == "prefix":
            self.last = Route(policy)
            return self._prefix.pick(candidates, request)
        index, now = self.index, time.monotonic()
        if index.full:  # a worker whose engine queue is full only while none has room
            full = {address for address in index.full if self.engine_full(address, now)}
            if full:
                candidates = [w for w in candidates if w.address not in full] or candidates
        if not index.workers or not any(self._routable(w.address) for w in candidates):
            self.fallbacks_total += 1
            self.last = Route(policy, 0, "fallback")
            if policy == "kv_aware":
                return self._prefix.pick(candidates, request)
            return self._p2c.pick(candidates, request)
        hits: dict[str, int] = {}
        prompt = 0
        anchor: int | None = None  # the prompt's first block no worker holds (or its last)
        if policy == "kv_aware" and index.block_size:
            encoded = self._encoded
            tokens = encoded[1] if encoded is not None and encoded[0] is request else None
            if tokens is None:
                tokens = _text_tokens(request)
            prompt = len(tokens)
            hits, anchor = index.match(tokens)
        if len(candidates) > SAMPLE_ABOVE:  # every holder, and a few others at random
            members = self._by_addresses(candidates)
            holders = [w for address in hits if (w := members.get(address)) is not None]
            candidates = holders + self._rng.sample(candidates, SAMPLED)
        return self._cheapest(candidates, prompt, hits, anchor, now)

    def _by_addresses(self, candidates: list[Worker]) -> dict[str, Worker]:
        """The candidates by address: the pool's `Roster` keeps them; other lists are
        made again only when they are not the same workers as the last time (a
        comparison of identities in C, not a loop in Python)."""
        if isinstance(candidates, Roster):
            return candidates.by_address
        if candidates != self._members:
            self._members = list(candidates)
            self._by_address = {w.address: w for w in candidates}
        return self._by_address

    def _routable(self, address: str) -> bool:
        """Whether the policy has something of the worker's engine to route on: events
        (kv_aware), or events or a load record (least_load; an `upstream: openai`
        worker's `/metrics` gives a load without events, numbered below any batch)."""
        kv = self.index.workers.get(address)
        if kv is None:
            return False
        return kv.sequence >= 0 or (self.policy == "least_load" and kv.load is not None)

    def _cheapest(
        self,
        candidates: list[Worker],
        prompt: int,
        hits: dict[str, int],
        anchor: int | None,
        now: float,
    ) -> Worker:
        """The candidate of the lowest cost (see the module), costing only what can win:
        a candidate whose prefill alone is past the best so far is left there (every other
        term adds to it: the weights are at least 0, as a load's counts), and the
        tie-break's hash is made on a tie only. The same pick as costing every one."""
        config, workers, size = self.config, self.index.workers, self.index.block_size
        prefill, unit = config.prefill_weight, max(size * config.prefill_weight, 1.0)
        queue, usage, per_running = config.queue_weight, config.usage_cost, config.running_cost
        best = candidates[0]
        best_units, best_calls = math.inf, 0
        best_spread: float | None = None  # made on a tie only
        for worker in candidates:
            address = worker.address
            uncached = prompt - hits.get(address, 0) * size
            cost = prefill * uncached if uncached > 0 else 0.0
            if cost // unit > best_units:
                continue
            calls = running = worker.outstanding
            load = _fresh(workers.get(address), now)
            if load is not None:
                cost += queue * load.waiting_uncached_tokens
                cost += usage * load.kv_usage
                running = max(running, load.running + load.waiting)
            cost += per_running * running
            # within a block of prefill counts as a tie; then fewer calls; then the worker
            # the prompt's new content hashes to (rendezvous), so that a prefix no worker
            # holds yet lands on one worker, the same from every replica, and is not copied
            # into every cache; chance for a prompt shorter than a block
            units = cost // unit
            if units < best_units or (units == best_units and calls < best_calls):
                best, best_units, best_calls, best_spread = worker, units, calls, None
            elif units == best_units and calls == best_calls:
                if best_spread is None:
                    best_spread = self._spread(anchor, best.address)
                spread = self._spread(anchor, address)
                if spread < best_spread:
                    best, best_spread = worker, spread
        self.last = Route(self.policy, hits.get(best.address, 0))
        return best

    def _spread(self, anchor: int | None, address: str) -> float:
        return self._rng.random() if anchor is None else _rendezvous(anchor, address)

    @property
    def sheds(self) -> bool:
        """Whether load records can make a worker full (`max_engine_waiting`,
        `max_kv_usage`)."""
        config = self.config
        return config.max_engine_waiting is not None or config.max_kv_usage is not None

    def _over(self, load: EngineLoad) -> bool:
        """Whether a load record says that more requests wait than `max_engine_waiting`
        or that the KV cache is `max_kv_usage` full (`KvIndex.full` keeps who said so)."""
        config = self.config
        waiting, usage = config.max_engine_waiting, config.max_kv_usage
        return (waiting is not None and load.waiting > waiting) or (
            usage is not None and load.kv_usage >= usage
        )

    def engine_full(self, address: str, now: float | None = None) -> bool:
        """Whether the worker's engine said it is full (`_over`) in a load record of the
        last `LOAD_FRESH` seconds; False without such a record."""
        if address not in self.index.full:
            return False
        now = time.monotonic() if now is None else now
        return _fresh(self.index.workers[address], now) is not None

    # -- sessions ---------------------------------------------------------------------

    def _session_worker(self, session: str, candidates: list[Worker]) -> Worker | None:
        address = self.sessions.get(session)
        if address is None:
            return None
        worker = self._by_addresses(candidates).get(address)
        if worker is None:
            return None
        average = outstanding(candidates) / len(candidates)
        if worker.outstanding > self.config.session_load_factor * average + 1:
            self.session_moves_total += 1
            return None
        self.sessions.move_to_end(session)
        return worker

    def _remember(self, session: str, address: str) -> None:
        sessions = self.sessions
        sessions[session] = address
        sessions.move_to_end(session)
        if len(sessions) > self.config.max_sessions:
            sessions.popitem(last=False)

    def view(self, address: str) -> dict[str, object]:
        """What routing knows of a worker, for `/admin/workers`."""
        kv = self.index.workers.get(address)
        load = None if kv is None or kv.load is None else kv.load._asdict()
        return {
            "policy": self.policy,
            "events": self.states.get(address, "none" if self.uses_events else "off"),
            "cached_blocks": 0 if kv is None else len(kv.blocks),
            "load": load,
            "load_scrape": self.scrapes.get(address, "off"),
            "engine_full": self.engine_full(address),
        }
