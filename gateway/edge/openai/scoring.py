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
distinct texts a request, none empty. The scores are computed in one pass a vector
(`math.sumprod` where Python has it), on the event loop for up to 256 Ki floats of vectors,
else in a thread (embeddings.py: 2,048 vectors of 1,024 floats took 0.36 s of Python 3.11).
`user` goes to workers that list it, as on embeddings. vLLM's scoring options that change
what is computed (`use_activation`, truncation, instructions and template kwargs,
multimodal inputs) and `dimensions` are refused by name unless at their defaults.
"""

from __future__ import annotations

import math
import operator
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.edge.errors import invalid
from gateway.edge.openai.embeddings import MAX_INPUTS, EmbeddingsRoute, Pooled, user_of
from gateway.edge.openai.validation import _unserved, model_of
from gateway.protocol.types import Embeddings

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
    """A string or a non-empty list of them, as a list, or a 400 naming `param`."""
    if isinstance(value, list):
        if not value:
            raise invalid(param, f"Invalid value for '{param}': an empty list.")
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


def _usage(embeddings: Embeddings) -> dict[str, int]:
    tokens = embeddings.prompt_tokens
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

    def answer(self, model: str, embeddings: Embeddings) -> bytes:
        scores = cosines(embeddings, [(self.query, place) for place in self.places])
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if self.top_n:
            ranked = ranked[: self.top_n]
        results = []
        for i in ranked:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if self.return_documents:
                result["document"] = {"text": self.documents[i]}
            results.append(result)
        return orjson.dumps(
            {
                "id": "rerank-" + secrets.token_hex(12),
                "model": model,
                "usage": _usage(embeddings),
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

    def answer(self, model: str, embeddings: Embeddings) -> bytes:
        scores = cosines(embeddings, self.pairs)
        usage = {**_usage(embeddings), "completion_tokens": 0}
        return orjson.dumps(
            {
                "id": "score-" + secrets.token_hex(12),
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": [
                    {"index": i, "object": "score", "score": score}
                    for i, score in enumerate(scores)
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


class RerankRoute(EmbeddingsRoute):
    """`POST /v1/rerank` on the embeddings' route."""

    def parse(self, body: Any) -> Pooled:
        return parse_rerank(body)


class ScoreRoute(EmbeddingsRoute):
    """`POST /v1/score` on the embeddings' route."""

    def parse(self, body: Any) -> Pooled:
        return parse_score(body)
