"""What the fleet needs of a worker, whatever it speaks: an `Upstream` (one
worker at one address) and the `UpstreamCall` of one request on it. Our gRPC
protocol (`furnace_grpc`) and OpenAI-compatible HTTP (`openai_http`) implement
them; a new way of reaching workers is one more module beside those."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gateway.protocol import errors, features
from gateway.protocol.types import (
    AudioRequest,
    Classifications,
    Embeddings,
    EmbedRequest,
    Event,
    GenerateRequest,
    RerankRequest,
    Scores,
    Tokens,
    Transcript,
)

#: How a call ended, for the owner's bookkeeping: None (finished), the error, or
#: CANCELLED when we cancelled it (which says nothing about the worker).
CANCELLED = "cancelled"
#: A request of a shared call (the multiplexed one) that broke, other than the one that
#: reports the call's failure: one broken call is one failure of its worker.
SHARED_FAILURE = "shared_failure"
CallEnd = errors.GatewayError | str | None
#: Seconds a call whose engine took the request (an HTTP upstream's 200 head, a gRPC
#: call sent) waits for its first event before it says `Started` all the same. A
#: refusal an engine streams as its first event comes within it and is answered as its
#: status (vLLM's CPU build on a 2-core VM streamed an out-of-vocabulary `logit_bias`
#: refusal 1.1-1.9 ms after its head, 5.5 ms for its first request); past it, the edge's
#: head goes out while the engine prefills (its first token came 11-30 ms after its
#: head), as vLLM's own server and the Rust routers send theirs, and the client's work
#: on a head (httpx's, the SDK's) overlaps the prefill instead of delaying the first
#: token: about 1 ms on that VM (`benchmarks/bench_vllm.py --relay`).
HEAD_GRACE = 0.005


#: Between a data-parallel server's address and one engine's rank, in the engine's name as
#: a worker (`gateway.fleet.data_parallel`).
RANK_MARK = "#dp"


def engine_address(server: str, rank: int | None) -> str:
    """The name of a server's engine of data-parallel `rank` as a worker (None: the
    server's own address)."""
    return server if rank is None else f"{server}{RANK_MARK}{rank}"


def engine_rank(ranks: tuple[int, ...] | None, index: int) -> int:
    """The data-parallel rank of a server's `index`-th engine (`ADDRESS#dpI`). vLLM pins a
    request to an engine by its index among the server's own (`data_parallel_rank`: 0 to
    N-1, also on a server that runs ranks 8 to 15 under hybrid load balancing), and names
    the engine by its rank in its `/metrics` samples, its load records, its KV events and
    their ports. `ranks`: those the server says it runs; the index where it does not say,
    or runs fewer."""
    return ranks[index] if ranks is not None and index < len(ranks) else index


#: Data-parallel engines believed of one server at most (`ModelDescription.engine_ranks`:
#: vLLM's groups are far smaller; `data_parallel_size` takes up to 256).
MAX_ENGINE_RANKS = 4096


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """One model a worker says it serves."""

    name: str
    max_context: int
    #: Requests the worker says it can run at once; None: it does not say.
    capacity: int | None = None
    #: Requests it runs now, from every client (None: it does not say).
    load: int | None = None
    #: It says it takes no more without queueing them (e.g. vLLM with requests waiting
    #: or its KV cache full).
    full: bool = False
    #: What it serves beyond plain generation (`gateway.protocol.features`).
    features: frozenset[str] = features.FIRST_VERSION
    #: The connector its engine hands KV blocks to another engine with (vLLM's
    #: `--kv-transfer-config`, e.g. `NixlConnector`); "": it has none; None: it does
    #: not say. A split model's workers need one (`prefill_workers`).
    kv_connector: str | None = None
    #: That connector's role (vLLM's `kv_role`: `kv_producer` hands blocks on,
    #: `kv_consumer` takes them, `kv_both` does either); "" or None: it does not say.
    kv_role: str | None = None
    #: The data-parallel ranks of the engines its server runs, in order (vLLM's
    #: `--data-parallel-size` N: 0 to N-1; a server of external or hybrid load balancing
    #: runs a slice of the ranks); None: it does not say.
    engine_ranks: tuple[int, ...] | None = None


class StreamBookkeeping:
    """What every worker stream does alike: it knows its worker, and it tells
    its owner how the call ended, exactly once, whatever ends it."""

    __slots__ = ("_closed", "_on_close", "worker")

    def __init__(self, worker: str, on_close: Callable[[CallEnd], None]) -> None:
        self.worker = worker
        self._on_close = on_close
        self._closed = False

    def close(self, outcome: CallEnd = None) -> None:
        """Marks the call over; tells the owner how, exactly once."""
        if not self._closed:
            self._closed = True
            self._on_close(outcome)


class UpstreamCall(Protocol):
    """One call: our events in order; ends by `Finished` or a `GatewayError`."""

    worker: str

    def __aiter__(self) -> AsyncIterator[Event]: ...

    async def __anext__(self) -> Event: ...

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Stops the call; the worker sees it."""

    def close(self, outcome: CallEnd = None) -> None:
        """Marks the call over, telling the owner `outcome` once."""


@runtime_checkable
class LoadsAdapters(Protocol):
    """An upstream whose workers load LoRA adapters when asked (`fleet.adapters`)."""

    async def load_adapter(self, name: str, path: str, timeout: float) -> None:  # noqa: ASYNC109
        """Loads the adapter `name` from `path` on the worker within `timeout` seconds;
        one it holds already is loaded. `Failed` when the worker cannot (the operator's
        to fix), `Unavailable` when unreachable."""


@runtime_checkable
class Reranks(Protocol):
    """An upstream whose workers score pairs with a cross-encoder themselves
    (`models[].scoring: cross-encoder`)."""

    async def rerank(
        self,
        request: RerankRequest,
        timeout: float,  # noqa: ASYNC109 (an HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Scores:
        """Each document's relevance to the query, within `timeout` seconds; raises
        `GatewayError` as `Upstream.call` refuses."""


@runtime_checkable
class Classifies(Protocol):
    """An upstream whose workers classify inputs with a classification model (vLLM's
    `/classify`)."""

    async def classify(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (an HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Classifications:
        """A classification of each input, within `timeout` seconds; raises
        `GatewayError` as `Upstream.call` refuses."""


@runtime_checkable
class Transcribes(Protocol):
    """An upstream whose workers write speech down (vLLM's and OpenAI's
    `/audio/transcriptions` and `/audio/translations`)."""

    async def transcribe(
        self,
        request: AudioRequest,
        timeout: float,  # noqa: ASYNC109 (an HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
        on_text: Callable[[str], Awaitable[None]] | None = None,
    ) -> Transcript:
        """The transcript, within `timeout` seconds; a streamed request's text handed to
        `on_text` piece by piece as it comes. Raises `GatewayError` as `Upstream.call`
        refuses."""


@runtime_checkable
class Prefills(Protocol):
    """An upstream whose servers prefill a prompt for another to decode
    (`models[].prefill_workers`: vLLM's, with its NixlConnector; its OpenAI server and its
    gRPC server)."""

    async def prefill(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the call's own bound, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> GenerateRequest:
        """The prompt prefilled, its KV blocks kept, within `timeout` seconds: `request`
        as the decode worker takes it (where the blocks are, `kv_transfer`). Raises
        `GatewayError` as `Upstream.call` refuses, and `Failed` for an answer that does
        not say where the blocks are."""


@runtime_checkable
class Tokenizes(Protocol):
    """An upstream that shows a prompt's tokens and decodes ids by its model's tokenizer
    (the gateway's `/tokenize` and `/detokenize`): our workers that list "tokenize", an
    OpenAI-compatible server with vLLM's routes, the gateway's own tokenizer (`vllm-grpc`)."""

    async def tokenize(
        self,
        request: GenerateRequest,
        token_strs: bool,
        timeout: float,  # noqa: ASYNC109 (a gRPC deadline or HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Tokens:
        """The ids of the prompt `request` makes (the ones `count_tokens` counts), with
        their strings when `token_strs`, within `timeout` seconds; raises `GatewayError`
        (`CannotCount` where the model's workers cannot)."""

    async def detokenize(
        self,
        model: str,
        ids: list[int],
        timeout: float,  # noqa: ASYNC109 (a gRPC deadline or HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> str:
        """The text `ids` decode to by `model`'s tokenizer, special tokens kept, within
        `timeout` seconds; an id outside its vocabulary is `Invalid` naming `tokens`."""


class Upstream(Protocol):
    """One worker at one address."""

    address: str

    def call(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = ...,
    ) -> UpstreamCall:
        """Starts a call; `timeout` seconds is its deadline."""

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (a gRPC deadline or HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        """Embeds the inputs with an embedding model, within `timeout` seconds;
        raises `GatewayError` as `call` refuses."""

    async def count_tokens(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (a gRPC deadline or HTTP timeout, not ours to wrap)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """The tokens of the prompt `request` makes, by the model's tokenizer, within
        `timeout` seconds; raises `GatewayError` as `call` refuses."""

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The models it serves."""

    def watch_health(self, poll_interval: float, deadline: float) -> AsyncIterator[bool]:
        """Whether it serves, as that changes (a check every `poll_interval` where it
        cannot be watched, each allowed `deadline` seconds); raises `GatewayError` when
        unreachable."""

    async def close(self) -> None:
        """Releases its connections."""
