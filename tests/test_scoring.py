"""Specs: `/v1/rerank` and `/v1/score` against the real gateway: with the demo workers,
each score is the cosine similarity of the vectors `/v1/embeddings` gives for the same
texts (rerank's order, `top_n`, `return_documents`, documents as objects; score one
against many and pairwise, and vLLM's other names for its sides); the refusals, each
naming its parameter; and against vLLM's own server for the tiny model as an embedding
model, the gateway's scores equal the ones vLLM's `/score` and `/rerank` give; for a tiny
cross-encoder (`scoring: cross-encoder`), the scores are the server's own, as it gives them
served directly; and `/classify`, a classification model's own classes."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import pytest

from gateway.config import ModelConfig
from gateway.edge.openai.scoring import cross_encoded
from gateway.protocol import errors
from gateway.protocol.types import EmbedRequest, RerankRequest, Scores
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.servers import (
    DEMO_MODEL,
    Gateway,
    ServerLoop,
    Workers,
    make_config,
    start_gateway,
)
from tests.support.tiny_model import build_classifier
from tests.support.vllm import VllmProcess, start_http_server
from tests.support.vllm_worker import EMBED_MODEL, EMBED_OPTIONS
from tests.support.waiting import HANG_GUARD

DOCUMENTS = ["a cat sat on the mat", "the market fell today", "a cat on a mat", "mats"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=HANG_GUARD)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def _vectors(url: str, model: str, texts: list[str]) -> list[list[float]]:
    reply = _post(url, "/v1/embeddings", {"model": model, "input": texts})
    assert reply.status_code == 200, reply.text
    return [item["embedding"] for item in reply.json()["data"]]


def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(gateway):
    query = "a cat sat on the mat"
    query_vector, *vectors = _vectors(gateway.url, DEMO_MODEL, [query, *DOCUMENTS])
    expected = [_cosine(query_vector, v) for v in vectors]
    reply = _post(
        gateway.url,
        "/v1/rerank",
        {"model": DEMO_MODEL, "query": query, "documents": DOCUMENTS, "top_n": 3},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == DEMO_MODEL and body["id"].startswith("rerank-")
    results = body["results"]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in results] == order
    for result in results:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]])
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert results[0]["relevance_score"] == pytest.approx(1.0)  # the query itself
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    bare = _post(
        gateway.url,
        "/v1/rerank",
        {
            "model": DEMO_MODEL,
            "query": query,
            "documents": [{"text": d} for d in DOCUMENTS],
            "return_documents": False,
        },
    ).json()["results"]
    assert len(bare) == 4 and all("document" not in r for r in bare)


def _ranking(results: list) -> tuple[list[int], list[float]]:
    """The indices and scores of rerank results (dicts or Cohere's objects)."""
    pairs = [
        (r["index"], r["relevance_score"]) if isinstance(r, dict) else (r.index, r.relevance_score)
        for r in results
    ]
    return [i for i, _ in pairs], [score for _, score in pairs]


def test_cohere_clients_rerank_at_its_paths_and_vllms_unversioned_paths_serve_too(gateway):
    """Cohere's SDK (`Client` posts to /v1/rerank, `ClientV2` to /v2/rerank) gets the
    same ranking as /v1/rerank; vLLM's /rerank and /score are the same routes too."""
    query = "a cat sat on the mat"
    body = {"model": DEMO_MODEL, "query": query, "documents": DOCUMENTS, "top_n": 2}
    order, scores = _ranking(_post(gateway.url, "/v1/rerank", body).json()["results"])
    with httpx.Client(timeout=HANG_GUARD) as http:
        v2 = cohere.ClientV2(api_key="none", base_url=gateway.url, httpx_client=http)
        answer = v2.rerank(model=DEMO_MODEL, query=query, documents=DOCUMENTS, top_n=2)
        assert _ranking(answer.results)[0] == order
        assert _ranking(answer.results)[1] == pytest.approx(scores)
        v1 = cohere.Client(api_key="none", base_url=gateway.url, httpx_client=http)
        answer = v1.rerank(
            model=DEMO_MODEL, query=query, documents=DOCUMENTS, top_n=2, return_documents=True
        )
        assert _ranking(answer.results)[0] == order
        assert [r.document.text for r in answer.results] == [DOCUMENTS[i] for i in order]
        with pytest.raises(cohere.BadRequestError) as refused:
            v2.rerank(model=DEMO_MODEL, query=query, documents=DOCUMENTS, max_tokens_per_doc=64)
        assert refused.value.body["error"]["param"] == "max_tokens_per_doc"
    unversioned = _post(gateway.url, "/rerank", body).json()["results"]
    assert _ranking(unversioned)[0] == order
    pair = {"model": DEMO_MODEL, "text_1": query, "text_2": DOCUMENTS[0]}
    assert _post(gateway.url, "/score", pair).json()["data"][0]["score"] == pytest.approx(1.0)


def test_score_one_against_many_and_pairwise(gateway):
    vectors = dict(zip(DOCUMENTS, _vectors(gateway.url, DEMO_MODEL, DOCUMENTS), strict=True))
    one = _post(
        gateway.url,
        "/v1/score",
        {"model": DEMO_MODEL, "text_1": DOCUMENTS[0], "text_2": DOCUMENTS[1:]},
    ).json()
    assert one["object"] == "list" and one["model"] == DEMO_MODEL
    assert [d["index"] for d in one["data"]] == [0, 1, 2]
    for item, document in zip(one["data"], DOCUMENTS[1:], strict=True):
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(_cosine(vectors[DOCUMENTS[0]], vectors[document]))
    pairwise = _post(
        gateway.url,
        "/v1/score",
        {"model": DEMO_MODEL, "queries": DOCUMENTS[:2], "documents": DOCUMENTS[2:]},
    ).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx(
        [_cosine(vectors[a], vectors[b]) for a, b in zip(DOCUMENTS[:2], DOCUMENTS[2:], strict=True)]
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "a"}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, "documents[1]"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        (
            "/v1/rerank",
            {"query": "a", "documents": ["b"], "use_activation": False},
            "use_activation",
        ),
        ("/v1/score", {"text_1": "a"}, "text_2"),
        ("/v1/score", {"documents": ["a"]}, "queries"),
        ("/v1/score", {}, "text_1"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "dimensions": 8}, "dimensions"),
        ("/v1/score", {"text_1": "a", "text_2": [{"text": "b"}]}, "text_2[0]"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "instruction": "x"}, "instruction"),
        # one text repeated: a result each, bounded as distinct ones are (the event loop
        # had spent 1.5 s on 200,000 of one document)
        ("/v1/rerank", {"query": "a", "documents": ["b"] * 2049}, "documents"),
        ("/v1/score", {"text_1": "a", "text_2": ["b"] * 2049}, "text_2"),
    ],
)
def test_refusals_name_their_parameter(gateway, path, body, param):
    reply = _post(gateway.url, path, {"model": DEMO_MODEL, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_a_model_that_serves_no_embeddings_is_refused(gateway):
    reply = _post(
        gateway.url, "/v1/rerank", {"model": SCRIPTED_MODEL, "query": "a", "documents": ["b"]}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def vllm_embedder(
    server_loop: ServerLoop,
    workers: Workers,
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Gateway, VllmProcess]]:
    """vLLM's own server for the tiny model as an embedding model, behind a gateway."""
    server = start_http_server(
        vllm_model, tmp_path_factory.mktemp("score-logs"), EMBED_MODEL, EMBED_OPTIONS
    )
    model = ModelConfig(
        EMBED_MODEL, workers=(f"http://127.0.0.1:{server.port}/v1",), upstream="openai"
    )
    gw = start_gateway(server_loop, make_config(workers, models=(model,)))
    yield gw, server
    gw.stop()
    server.stop()


@pytest.mark.vllm
@pytest.mark.timeout(300)  # a vLLM server starts for these (~30 s)
def test_scores_equal_vllms_own_for_an_embedding_model(vllm_embedder):
    gw, server = vllm_embedder
    direct = f"http://127.0.0.1:{server.port}"
    body = {"model": EMBED_MODEL, "text_1": DOCUMENTS[0], "text_2": DOCUMENTS[1:]}
    ours, theirs = _post(gw.url, "/v1/score", body).json(), _post(direct, "/v1/score", body)
    assert theirs.status_code == 200, theirs.text
    assert "data" in ours, ours
    assert [d["score"] for d in ours["data"]] == pytest.approx(
        [d["score"] for d in theirs.json()["data"]], abs=1e-3
    )
    assert ours["usage"]["prompt_tokens"] == theirs.json()["usage"]["prompt_tokens"]
    rerank = {"model": EMBED_MODEL, "query": DOCUMENTS[0], "documents": DOCUMENTS}
    ours, theirs = (
        _post(gw.url, "/v1/rerank", rerank).json(),
        _post(direct, "/v1/rerank", rerank),
    )
    assert theirs.status_code == 200, theirs.text
    assert [r["index"] for r in ours["results"]] == [r["index"] for r in theirs.json()["results"]]
    assert [r["relevance_score"] for r in ours["results"]] == pytest.approx(
        [r["relevance_score"] for r in theirs.json()["results"]], abs=1e-3
    )


#: The tiny cross-encoder's name (a reranker: vLLM's pooling runner, a one-label head).
RERANKER = "tiny-reranker"
#: The same server named as a model scored by its embeddings, which it does not serve.
NOT_EMBEDDER = "tiny-reranker-as-embedder"


@pytest.fixture(scope="module")
def vllm_reranker(
    server_loop: ServerLoop,
    workers: Workers,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Gateway, str]]:
    """vLLM's own server for a tiny cross-encoder, behind a gateway that knows it as one
    (`scoring: cross-encoder`) and, under another name, as an embedding model."""
    model_dir = build_classifier(tmp_path_factory.mktemp("tiny-reranker"), labels=1)
    names = ("--served-model-name", RERANKER, NOT_EMBEDDER)  # the last one given wins
    server = start_http_server(
        model_dir, tmp_path_factory.mktemp("rerank-logs"), RERANKER, ("--runner", "pooling", *names)
    )
    url = f"http://127.0.0.1:{server.port}"
    models = (
        ModelConfig(RERANKER, workers=(f"{url}/v1",), upstream="openai", scoring="cross-encoder"),
        ModelConfig(NOT_EMBEDDER, workers=(f"{url}/v1",), upstream="openai"),
    )
    gw = start_gateway(server_loop, make_config(workers, models=models))
    yield gw, url
    gw.stop()
    server.stop()


def _theirs(url: str, path: str, body: dict) -> dict:
    reply = _post(url, path, {**body, "model": RERANKER})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.vllm
@pytest.mark.timeout(300)  # a vLLM server starts for these (~30 s)
def test_a_cross_encoder_scores_each_pair_itself_as_vllm_does(vllm_reranker):
    """Rerank and score of a cross-encoder are its workers' own scores (vLLM's
    `/rerank` and `/score` served directly give the same), usage included; top_n and
    return_documents are applied by the gateway, as vLLM applies them."""
    gw, direct = vllm_reranker
    query = "a cat sat on the mat"
    body = {"model": RERANKER, "query": query, "documents": DOCUMENTS}
    ours, theirs = _post(gw.url, "/v1/rerank", body).json(), _theirs(direct, "/v1/rerank", body)
    assert _ranking(ours["results"])[0] == _ranking(theirs["results"])[0]
    assert _ranking(ours["results"])[1] == pytest.approx(_ranking(theirs["results"])[1], abs=1e-3)
    assert len(set(_ranking(ours["results"])[1])) > 1  # scores that tell documents apart
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    assert ours["model"] == RERANKER and ours["id"].startswith("rerank-")
    assert [r["document"]["text"] for r in ours["results"]] == [
        r["document"]["text"] for r in theirs["results"]
    ]
    top = _post(gw.url, "/v1/rerank", {**body, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == _ranking(theirs["results"])[0][:2]
    assert all("document" not in r for r in top["results"])
    # score: one against many, then pairwise with a first text of its own each
    one = {"text_1": query, "text_2": DOCUMENTS}
    ours, theirs = (
        _post(gw.url, "/v1/score", {**one, "model": RERANKER}).json(),
        _theirs(direct, "/v1/score", one),
    )
    assert [d["score"] for d in ours["data"]] == pytest.approx(
        [d["score"] for d in theirs["data"]], abs=1e-3
    )
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    pairwise = {"queries": [query, DOCUMENTS[1], query], "documents": DOCUMENTS[1:]}
    ours = _post(gw.url, "/v1/score", {**pairwise, "model": RERANKER}).json()
    theirs = _theirs(direct, "/v1/score", pairwise)
    assert [d["score"] for d in ours["data"]] == pytest.approx(
        [d["score"] for d in theirs["data"]], abs=1e-3
    )
    assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    with httpx.Client(timeout=HANG_GUARD) as http:  # Cohere's SDK, at /v2/rerank
        v2 = cohere.ClientV2(api_key="none", base_url=gw.url, httpx_client=http)
        answer = v2.rerank(model=RERANKER, query=query, documents=DOCUMENTS, top_n=2)
    assert _ranking(answer.results)[0] == [r["index"] for r in top["results"]]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_document_given_twice_is_scored_once_and_ranked_twice(vllm_reranker):
    gw, direct = vllm_reranker
    documents = [DOCUMENTS[0], DOCUMENTS[1], DOCUMENTS[0]]
    body = {"model": RERANKER, "query": "cats", "documents": documents}
    ours = _post(gw.url, "/v1/rerank", body).json()
    scores = {r["index"]: r["relevance_score"] for r in ours["results"]}
    assert scores[0] == scores[2] and len(scores) == 3
    once = _theirs(direct, "/v1/rerank", {**body, "documents": documents[:2]})
    assert ours["usage"]["prompt_tokens"] == once["usage"]["prompt_tokens"]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_a_cross_encoder_named_an_embedding_model_is_refused_naming_model(vllm_reranker):
    """Scored by embeddings (the default), a model whose server embeds nothing is a 400
    naming `model`; so are its embeddings; the cross-encoder's own are the same."""
    gw, _ = vllm_reranker
    for model, path, body in (
        (NOT_EMBEDDER, "/v1/rerank", {"query": "a", "documents": ["b"]}),
        (NOT_EMBEDDER, "/v1/score", {"text_1": "a", "text_2": "b"}),
        (RERANKER, "/v1/embeddings", {"input": "a"}),
    ):
        reply = _post(gw.url, path, {"model": model, **body})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "model"


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_classify_gives_the_workers_own_classes(vllm_reranker):
    """`/classify` (and `/v1/classify`): a classification model's labels and probabilities,
    as vLLM's own `/classify` gives them; vLLM's options that change them are refused by
    name."""
    gw, direct = vllm_reranker
    body = {"model": RERANKER, "input": DOCUMENTS[:3]}
    theirs = _theirs(direct, "/classify", body)
    for path in ("/classify", "/v1/classify"):
        ours = _post(gw.url, path, body).json()
        assert ours["model"] == RERANKER and ours["id"].startswith("classify-"), ours
        assert [(d["index"], d["label"], d["num_classes"]) for d in ours["data"]] == [
            (d["index"], d["label"], d["num_classes"]) for d in theirs["data"]
        ]
        assert [d["probs"] for d in ours["data"]] == [
            pytest.approx(d["probs"], abs=1e-3) for d in theirs["data"]
        ]
        assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
    one = _post(gw.url, "/classify", {"model": RERANKER, "input": DOCUMENTS[0]}).json()
    assert one["data"][0]["probs"] == pytest.approx(theirs["data"][0]["probs"], abs=1e-3)
    for asked, param in (
        ({"model": RERANKER, "use_activation": False}, "use_activation"),
        # the chat form (tests/test_pooling_chat.py) takes `messages` instead of `input`
        ({"model": RERANKER, "messages": [{"role": "user", "content": "a"}]}, "input"),
    ):
        refused = _post(gw.url, "/classify", {"input": "a", **asked})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param


def test_classify_is_refused_naming_model_where_workers_have_no_classification(gateway):
    """Our worker protocol has no classification call: a 400 naming `model`."""
    reply = _post(gateway.url, "/classify", {"model": DEMO_MODEL, "input": "a"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model", reply.text
    assert "does not serve classification" in reply.json()["error"]["message"]


def test_a_cross_encoders_pairs_go_one_call_a_distinct_first_text_and_fail_as_one():
    """Pairwise scores: one call for each distinct first text with its distinct second
    texts, each score back at its pair; a call that fails fails the request with its own
    error (not a group of them), the other calls cancelled."""
    request = EmbedRequest("m", ("q1", "d1", "q2", "d2"), user="u", request_id="r")
    pairs = [(0, 1), (2, 1), (0, 3), (0, 1), (2, 3)]
    asked: list[RerankRequest] = []

    async def calls(named: RerankRequest) -> tuple[Scores, str]:
        asked.append(named)
        score = {"q1": 0.1, "q2": 0.2}[named.query]
        return Scores(tuple(score + i for i in range(len(named.documents))), 5), "w"

    scores, worker = asyncio.run(cross_encoded(calls, request, pairs))
    assert sorted((a.query, a.documents) for a in asked) == [
        ("q1", ("d1", "d2")),
        ("q2", ("d1", "d2")),
    ]
    assert {(a.model, a.user, a.request_id) for a in asked} == {("m", "u", "r")}
    assert scores == Scores((0.1, 0.2, 1.1, 0.1, 1.2), 10) and worker == "w"

    async def failing(named: RerankRequest) -> tuple[Scores, str]:
        if named.query == "q2":
            raise errors.Unavailable("the worker went away")
        await asyncio.sleep(HANG_GUARD)
        raise AssertionError("not cancelled")

    with pytest.raises(errors.Unavailable):
        asyncio.run(cross_encoded(failing, request, pairs))
