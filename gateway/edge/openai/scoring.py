"""`POST /v1/rerank` and `POST /v1/score` (and their other paths, `RERANK_PATHS` and
`SCORE_PATHS`), as vLLM's server answers them for an embedding model: the texts
embedded by the model's workers (the embeddings' route, its admission, fallbacks,
bounds and telemetry: embeddings.py), each pair scored by the cosine
similarity of its two vectors, as vLLM scores pairs with an embedding model. Every worker
kind that serves embeddings serves these (ours, vLLM's gRPC server, OpenAI-compatible
servers); a model with a classification head (a cross-encoder such as a BGE reranker)
is not scored by these routes: its workers' own `/rerank` is not proxied.

Rerank (Jina's, vLLM's and Cohere's shape): `query` and `documents` (strings, or `{"text"}`
objects), `top_n` (0, the default: all), `return_documents` (true by default: vLLM always
returns them) → `results` by relevance, highest first, each with its `index` in
`documents`. Score: `text_1` and `text_2` (or vLLM's `queries` with `documents` or
`items`, or `data_1` with `data_2`), each a string or a list of strings: one against
many, or pairwise when both are lists of one length → `data`, a score a pair, in order.

Each distinct text is embedded, and its tokens counted, once; at most `MAX_INPUTS` (2,048)
distinct texts a request, and as many on a side (repeats counted), none empty. The scores
are computed in one pass a vector (`math.sumprod` where Python has it), on the event loop
for up to 256 Ki floats of vectors, else in a thread (embeddings.py: 2,048 vectors of 1,024
floats took 0.36 s of Python 3.11). `user` goes to workers that list it, as on embeddings.
vLLM's scoring options that change what is computed (`use_activation`, truncation,
instructions and template kwargs, multimodal inputs) and `dimensions` are refused by name
unless at their defaults.

A cross-encoder (`models[].scoring: cross-encoder`: a reranker served by vLLM with
`--runner pooling`) scores each pair itself, reading both texts at once, which no pair of
embeddings can: its workers' `/rerank` is called with each distinct query and the distinct
documents paired with it, the whole answer's scores taken (top_n and the documents are the
gateway's to apply), so a rerank is one call, and a pairwise score as many as it has
distinct first texts, `CROSS_ENCODER_CALLS` at once. The answer is the same either way.
"""

from __future__ import annotations

import asyncio
import math
import operator
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import orjson

from gateway.edge.errors import invalid
from gateway.edge.openai.embeddings import MAX_INPUTS, EmbeddingsRoute, Pooled, user_of
from gateway.edge.openai.validation import _unserved, model_of
from gateway.fleet import ModelPool
from gateway.fleet.embedding import rerank
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import Embeddings, EmbedRequest, Pooling, RerankRequest, Scores

#: vLLM's scoring options not served, with the value that asks nothing of them.
UNSERVED_SCORING: dict[str, Any] = {
    "truncate_prompt_tokens": None,
    "max_tokens_per_query": 0,
    "max_tokens_per_doc": 0,
    "instruction": None,
    "chat_template_kwargs": None,
    "use_activation": None,
    "mm_processor_kwargs": None,
    "priority": 0,
    "request_id": None,
    "cache_salt": None,
    "truncation_side": None,
    "dimensions": None,
    # Cohere's rerank (v1, v2)
    "rank_fields": None,
    "max_chunks_per_doc": None,
    "relevant_spans": None,
}
#: Where rerank and score are served: vLLM serves each at all of these, the versioned
#: rerank paths being Cohere's (its SDK's `Client` posts to v1, `ClientV2` to v2).
#: (Those outside /v1/ are also middleware.py's OTHER_API_PATHS: a key, JSON bodies.)
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
SCORE_PATHS = ("/v1/score", "/score")
#: The names of score's two sides, as vLLM takes them (the first pair present wins).
SCORE_SIDES: tuple[tuple[str, str], ...] = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)

#: A pairwise score's calls to a cross-encoder's workers at once (one a distinct first text).
CROSS_ENCODER_CALLS = 8

_dot: Callable[[Sequence[float], Sequence[float]], float] = getattr(
    math, "sumprod", lambda a, b: math.fsum(map(operator.mul, a, b))
)


def _text(value: Any, param: str, objects: bool = False) -> str:
    """A non-empty string (or, `objects`, a rerank document's `{"text": ...}`), or a 400."""
    if objects and isinstance(value, dict) and set(value) == {"text"}:
        value = value["text"]
    if not isinstance(value, str) or not value:
        raise invalid(param, f"Invalid value for '{param}': a non-empty string.")
    return value


def _texts(value: Any, param: str, objects: bool = False) -> list[str]:
    """A string or a non-empty list of them (at most `MAX_INPUTS`, repeats counted: each
    gets its own result, 200,000 of one document had held the event loop for 1.5 s), as a
    list, or a 400 naming `param`."""
    if isinstance(value, list):
        if not value:
            raise invalid(param, f"Invalid value for '{param}': an empty list.")
        if len(value) > MAX_INPUTS:
            raise invalid(param, f"Invalid value for '{param}': at most {MAX_INPUTS} texts.")
        return [_text(item, f"{param}[{i}]", objects) for i, item in enumerate(value)]
    return [_text(value, param, objects)]


def _distinct(texts: Iterable[str]) -> tuple[tuple[str, ...], dict[str, int]]:
    """The distinct texts, in order, and each text's place among them (at most
    `MAX_INPUTS`, or a 400)."""
    places: dict[str, int] = {}
    for text in texts:
        places.setdefault(text, len(places))
    if len(places) > MAX_INPUTS:
        raise invalid(None, f"At most {MAX_INPUTS} distinct texts a request are scored.")
    return tuple(places), places


def cosines(embeddings: Embeddings, pairs: Sequence[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of vectors (by their places)."""
    vectors = embeddings.vectors
    norms = [math.sqrt(_dot(v, v)) or 1.0 for v in vectors]
    return [_dot(vectors[a], vectors[b]) / (norms[a] * norms[b]) for a, b in pairs]


def scored(result: Pooling, pairs: Sequence[tuple[int, int]]) -> Scores:
    """A score for each pair (places of texts): a cross-encoder's, or the cosine of the
    pair's embeddings."""
    if isinstance(result, Scores):
        return result
    assert isinstance(result, Embeddings)  # no route classifies pairs
    return Scores(tuple(cosines(result, pairs)), result.prompt_tokens)


def _usage(scores: Scores) -> dict[str, int]:
    tokens = scores.prompt_tokens
    return {"prompt_tokens": tokens, "total_tokens": tokens}


@dataclass(frozen=True, slots=True)
class RerankBody:
    """A valid rerank body: the texts to embed and how to answer."""

    inputs: tuple[str | tuple[int, ...], ...]
    #: Each document's place in `inputs` (the query's is `query`).
    documents: tuple[str, ...]
    places: tuple[int, ...]
    query: int
    top_n: int
    return_documents: bool
    dimensions: int | None = None
    user: str = ""
    chat: None = None  # no chat form

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The query's place paired with each document's."""
        return tuple((self.query, place) for place in self.places)

    def answer(self, model: str, result: Pooling) -> bytes:
        score = scored(result, self.pairs)
        scores = score.values
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if self.top_n:
            ranked = ranked[: self.top_n]
        results = []
        for i in ranked:
            ranked_one: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if self.return_documents:
                ranked_one["document"] = {"text": self.documents[i]}
            results.append(ranked_one)
        return orjson.dumps(
            {
                "id": "rerank-" + secrets.token_hex(12),
                "model": model,
                "usage": _usage(score),
                "results": results,
            }
        )


def parse_rerank(body: Any) -> RerankBody:
    """The rerank body checked, or a 400 naming the parameter at fault."""
    model_of(body)
    _unserved(body, UNSERVED_SCORING)
    if "query" not in body:
        raise invalid("query", "Missing required parameter: 'query'.")
    if "documents" not in body:
        raise invalid("documents", "Missing required parameter: 'documents'.")
    query = _text(body["query"], "query")
    documents = _texts(body["documents"], "documents", objects=True)
    top_n = body.get("top_n", 0)
    if type(top_n) is not int or top_n < 0:
        raise invalid("top_n", "Invalid value for 'top_n': an integer of at least 0.")
    returned = body.get("return_documents", True)
    if not isinstance(returned, bool):
        raise invalid("return_documents", "Invalid type for 'return_documents': a boolean.")
    inputs, places = _distinct([query, *documents])
    return RerankBody(
        inputs,
        tuple(documents),
        tuple(places[d] for d in documents),
        places[query],
        top_n,
        returned,
        user=user_of(body),
    )


@dataclass(frozen=True, slots=True)
class ScoreBody:
    """A valid score body: the texts to embed and the pairs to score (places in them)."""

    inputs: tuple[str | tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    dimensions: int | None = None
    user: str = ""
    chat: None = None  # no chat form

    def answer(self, model: str, result: Pooling) -> bytes:
        score = scored(result, self.pairs)
        usage = {**_usage(score), "completion_tokens": 0}
        return orjson.dumps(
            {
                "id": "score-" + secrets.token_hex(12),
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": [
                    {"index": i, "object": "score", "score": value}
                    for i, value in enumerate(score.values)
                ],
                "usage": usage,
            }
        )


def parse_score(body: Any) -> ScoreBody:
    """The score body checked, or a 400 naming the parameter at fault."""
    model_of(body)
    _unserved(body, UNSERVED_SCORING)
    sides = next(((a, b) for a, b in SCORE_SIDES if a in body and b in body), None)
    if sides is None:  # the missing side of one the body began, or text_1's
        begun = next((pair for pair in SCORE_SIDES if pair[0] in body or pair[1] in body), None)
        missing = "text_1" if begun is None else begun[1] if begun[0] in body else begun[0]
        raise invalid(missing, f"Missing required parameter: '{missing}'.")
    first, second = (_texts(body[name], name) for name in sides)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise invalid(
            sides[1],
            f"'{sides[0]}' and '{sides[1]}' are lists of different lengths; a list is scored "
            "pairwise against one of its length, or one text against every one.",
        )
    inputs, places = _distinct([*first, *second])
    pairs = tuple((places[a], places[b]) for a, b in zip(first, second, strict=True))
    return ScoreBody(inputs, pairs, user=user_of(body))


async def cross_encoded(
    calls: Callable[[RerankRequest], Awaitable[tuple[Scores, str]]],
    request: EmbedRequest,
    pairs: Sequence[tuple[int, int]],
) -> tuple[Scores, str]:
    """A score for each pair (places in `request.inputs`) from a cross-encoder: one call
    (`calls`) for each distinct first text, with the distinct second texts paired with it,
    at most `CROSS_ENCODER_CALLS` at once (a failure cancels the others); the tokens of
    all, and the first call's worker."""
    texts = cast(tuple[str, ...], request.inputs)  # scoring takes texts alone
    groups: dict[int, dict[int, int]] = {}  # a first text -> its second texts, in order
    for first, second in pairs:
        documents = groups.setdefault(first, {})
        documents.setdefault(second, len(documents))
    gate = asyncio.Semaphore(CROSS_ENCODER_CALLS)

    async def one(query: int, documents: dict[int, int]) -> tuple[Scores, str]:
        async with gate:
            named = RerankRequest(
                request.model,
                texts[query],
                tuple(texts[d] for d in documents),
                request.user,
                request.request_id,
            )
            return await calls(named)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = {q: group.create_task(one(q, docs)) for q, docs in groups.items()}
    except BaseExceptionGroup as failed:  # the first failure, as one call would raise it
        raise failed.exceptions[0] from None
    answers = {q: task.result() for q, task in tasks.items()}
    values = tuple(answers[a][0].values[groups[a][b]] for a, b in pairs)
    tokens = sum(scores.prompt_tokens for scores, _ in answers.values())
    return Scores(values, tokens), next(iter(answers.values()))[1]


class _ScoringRoute(EmbeddingsRoute):
    """The embeddings' route scoring pairs: by their embeddings, or by a cross-encoder
    (`models[].scoring`)."""

    span = "furnace.engine/Score"
    what = "The scores"

    def work(
        self,
        pool: ModelPool,
        request: EmbedRequest,
        parsed: Pooled,
        deadline: Deadline,
        metadata: tuple[tuple[str, str], ...],
    ) -> Awaitable[tuple[Pooling, str]]:
        if pool.scoring != "cross-encoder":
            return super().work(pool, request, parsed, deadline, metadata)
        pairs = cast(RerankBody | ScoreBody, parsed).pairs

        def calls(named: RerankRequest) -> Awaitable[tuple[Scores, str]]:
            return rerank(self.fleet, pool, named, deadline, metadata)

        return cross_encoded(calls, request, pairs)


class RerankRoute(_ScoringRoute):
    """`POST /v1/rerank` on the embeddings' route."""

    def parse(self, body: Any) -> Pooled:
        return parse_rerank(body)


class ScoreRoute(_ScoringRoute):
    """`POST /v1/score` on the embeddings' route."""

    def parse(self, body: Any) -> Pooled:
        return parse_score(body)
