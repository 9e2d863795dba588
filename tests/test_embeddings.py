"""POST /v1/embeddings through the gateway, against real workers (the demo engine's SHA-256
vectors, and engines of this file's own behind real gRPC workers), read with the official
openai SDK (which asks for base64 by default) and httpx: the answer's shape and values, the
400s naming their parameter, models that do not serve embeddings, team keys and limits,
metrics, retries on another worker, a client that leaves, and the request timeout. After
each test every slot and worker call is free again (the fixtures check it)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import struct
import threading

import httpx
import openai
import pytest

from gateway.config import ModelConfig
from gateway.protocol import errors, features
from gateway.protocol.types import Embeddings, EmbedRequest
from gateway.worker.demo import DEMO_MODEL, DemoEngine, demo_vector
from tests.support.keys import assert_rate_limited, bearer, keyed, new_key
from tests.support.metrics import scrape, value
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.waiting import HANG_GUARD, wait_until

EMBEDDINGS = "/v1/embeddings"


def f32(values: tuple[float, ...] | list[float]) -> list[float]:
    """The values as float32 carries them (the worker protocol's `float`)."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def norm(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


@pytest.fixture
def sdk(gateway):
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as sdk:
        yield sdk


def _embedding_model(name: str, *addresses: str) -> tuple[ModelConfig, ...]:
    return (ModelConfig(name, workers=addresses),)


# -- the answer -------------------------------------------------------------------


def test_the_sdk_unchanged_gets_base64_decoded_and_float_alike(sdk, client):
    reply = sdk.embeddings.create(model=DEMO_MODEL, input="hello there world")
    assert reply.object == "list"
    assert reply.model == DEMO_MODEL
    assert [d.index for d in reply.data] == [0]
    assert reply.data[0].object == "embedding"
    assert reply.data[0].embedding == f32(demo_vector("hello there world"))
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 3
    assert norm(reply.data[0].embedding) == pytest.approx(1.0, abs=1e-6)

    as_floats = sdk.embeddings.create(
        model=DEMO_MODEL, input="hello there world", encoding_format="float"
    )
    assert as_floats.data[0].embedding == reply.data[0].embedding

    # on the wire: base64 of little-endian float32, as OpenAI and vLLM send it
    raw = client.post(
        EMBEDDINGS,
        json={"model": DEMO_MODEL, "input": "hello there world", "encoding_format": "base64"},
    )
    assert raw.status_code == 200
    assert raw.headers["x-request-id"]
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert packed == struct.pack("<32f", *demo_vector("hello there world"))
    assert set(raw.json()) == {"object", "data", "model", "usage"}


def test_a_list_of_strings_in_order(sdk):
    texts = ["one", "two words", "and three words"]
    reply = sdk.embeddings.create(model=DEMO_MODEL, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert [d.embedding for d in reply.data] == [f32(demo_vector(t)) for t in texts]
    assert reply.usage.prompt_tokens == 6


def test_token_arrays_one_or_many(sdk):
    one = sdk.embeddings.create(model=DEMO_MODEL, input=[101, 7, 2**32 - 1])
    assert len(one.data) == 1
    assert one.data[0].embedding == f32(demo_vector((101, 7, 2**32 - 1)))
    assert one.usage.prompt_tokens == 3
    many = sdk.embeddings.create(model=DEMO_MODEL, input=[[1, 2], [3], [0, 0, 0, 0]])
    assert [d.embedding for d in many.data] == [
        f32(demo_vector(ids)) for ids in ((1, 2), (3,), (0, 0, 0, 0))
    ]
    assert many.usage.prompt_tokens == 7


def test_dimensions_shorten_to_unit_vectors(sdk):
    reply = sdk.embeddings.create(model=DEMO_MODEL, input=["alpha", "beta"], dimensions=8)
    for item, text in zip(reply.data, ["alpha", "beta"], strict=True):
        assert len(item.embedding) == 8
        assert norm(item.embedding) == pytest.approx(1.0, abs=1e-6)
        assert item.embedding == f32(demo_vector(text, 8))


def test_the_async_sdk(gateway):
    async def embed() -> openai.types.CreateEmbeddingResponse:
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
        ) as sdk:
            replies = await asyncio.gather(
                *(sdk.embeddings.create(model=DEMO_MODEL, input=[f"text {i}"]) for i in range(8))
            )
            assert [r.data[0].embedding for r in replies] == [
                f32(demo_vector(f"text {i}")) for i in range(8)
            ]
            return replies[0]

    assert asyncio.run(embed()).usage.prompt_tokens == 2


def test_2048_inputs_are_served(client):
    inputs = [f"w{i}" for i in range(2048)]
    reply = client.post(EMBEDDINGS, json={"model": DEMO_MODEL, "input": inputs})
    assert reply.status_code == 200
    data = reply.json()["data"]
    assert len(data) == 2048
    assert data[-1]["index"] == 2047
    assert data[-1]["embedding"] == f32(demo_vector("w2047"))


# -- refusals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[1], []]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": [2**32]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [["a"]]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": 7}, "input"),
        ({"input": ["w"] * 2049}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "encoding_format": 1}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "dimensions": 8.0}, "dimensions"),
        ({"input": "a", "user": 5}, "user"),
        ({"input": "a", "user": "u" * 257}, "user"),
        ({"input": "a", "model": 5}, "model"),
        ({"input": "a", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": "a", "normalize": False}, "normalize"),
        ({"input": "a", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "a", "use_activation": True}, "use_activation"),
        ({"input": "a", "truncation_side": "left"}, "truncation_side"),
    ],
)
def test_bad_bodies_are_400_naming_the_parameter(client, workers, body, param):
    before = workers.demo_engine.embedded
    reply = client.post(EMBEDDINGS, json={"model": DEMO_MODEL, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert workers.demo_engine.embedded == before  # no worker saw it


def test_what_the_worker_refuses_reaches_the_client(client):
    # the demo's vectors have 32 values: more is the worker's 400, naming the parameter
    reply = client.post(EMBEDDINGS, json={"model": DEMO_MODEL, "input": "a", "dimensions": 64})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "dimensions"
    # an input past the demo's context (64 words here)
    reply = client.post(EMBEDDINGS, json={"model": DEMO_MODEL, "input": "w " * 65})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_unknown_and_unserving_models(sdk, client):
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.embeddings.create(model="no-such-model", input="a")
    assert missing.value.code == "model_not_found"
    # a worker of the first protocol version lists no features: generation only
    reply = client.post(EMBEDDINGS, json={"model": SCRIPTED_MODEL, "input": "a"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "model"
    assert "does not serve embeddings" in reply.json()["error"]["message"]
    # a tensor model
    reply = client.post(EMBEDDINGS, json={"model": "resnet-50", "input": "a"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "model"


class PlainEmbedder(DemoEngine):
    """Embeddings without `dimensions` or `user`."""

    features = DemoEngine.features - {features.DIMENSIONS, features.USER}


def test_dimensions_and_user_only_for_workers_that_list_them(gateway_with, serve_engines):
    (server,) = serve_engines(PlainEmbedder("furnace-plain"))
    gw = gateway_with(models=_embedding_model("furnace-plain", server.address))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        served = client.post(EMBEDDINGS, json={"model": "furnace-plain", "input": "a b"})
        assert served.status_code == 200
        for field, given in (("dimensions", 8), ("user", "someone")):
            body = {"model": "furnace-plain", "input": "a b", field: given}
            reply = client.post(EMBEDDINGS, json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == field
            assert f"does not support '{field}'" in reply.json()["error"]["message"]


# -- teams, metrics ----------------------------------------------------------------


def test_team_keys_allow_lists_and_limits_count_embeddings(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    teams = {
        "search": {"requests_per_minute": 2, "tokens_per_minute": 1000},
        "ads": {"models": [SCRIPTED_MODEL]},
    }
    gw = gateway_with(**keyed(teams, {search: "search", ads: "ads"}))
    team = gw.state.teams.by_name["search"]
    body = {"model": DEMO_MODEL, "input": ["one two three", "four five"]}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.post(EMBEDDINGS, json=body).status_code == 401
        first = client.post(EMBEDDINGS, json=body, headers=bearer(search))
        assert first.status_code == 200
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        # the inputs' tokens, as the worker counted them, once the call is settled
        wait_until(lambda: gw.state.teams.limiter.idle, "the request's tokens to be settled")
        assert team.tokens_charged == 5
        assert client.post(EMBEDDINGS, json=body, headers=bearer(search)).status_code == 200
        assert_rate_limited(
            client.post(EMBEDDINGS, json=body, headers=bearer(search)), "requests per minute"
        )
        hidden = client.post(EMBEDDINGS, json=body, headers=bearer(ads))
        assert hidden.status_code == 404
        assert hidden.json()["error"]["code"] == "model_not_found"
    wait_until(lambda: gw.state.teams.limiter.idle, "every request settled")
    assert team.tokens_charged == 10


def test_metrics_count_embeddings(gateway, client):
    before = scrape(gateway.url)
    assert client.post(EMBEDDINGS, json={"model": DEMO_MODEL, "input": ["a b", "c"]}).is_success
    assert client.post(EMBEDDINGS, json={"model": DEMO_MODEL, "input": ""}).status_code == 400
    after = scrape(gateway.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "furnace_gateway_requests_total"
    route = "/v1/embeddings"
    assert moved(requests, model=DEMO_MODEL, route=route, outcome="completed", status="200") == 1
    assert moved(requests, model=DEMO_MODEL, route=route, outcome="invalid", status="400") == 1
    assert moved("furnace_gateway_prompt_tokens_total", model=DEMO_MODEL) == 3
    assert moved("furnace_gateway_e2e_request_latency_seconds_count", model=DEMO_MODEL) == 1


# -- the fleet and the call ----------------------------------------------------------


class BusyEmbedder(DemoEngine):
    """Refuses every embedding as a full worker does."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.refusals = 0

    async def embed(self, request: EmbedRequest) -> Embeddings:
        self.refusals += 1
        raise errors.Busy("This worker is full.")


def test_a_refusing_worker_costs_no_request(gateway_with, serve_engines):
    busy, good = BusyEmbedder("furnace-twin"), DemoEngine("furnace-twin")
    servers = serve_engines(busy, good)
    gw = gateway_with(
        models=_embedding_model("furnace-twin", *(s.address for s in servers)),
        retry_attempts=2,
        retry_budget=1.0,
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for i in range(20):
            reply = client.post(EMBEDDINGS, json={"model": "furnace-twin", "input": f"x {i}"})
            assert reply.status_code == 200, reply.text
    assert busy.refusals > 0  # each pick is a coin toss: 2^-20 that it never came up
    assert good.embedded == 20
    assert gw.state.fleet.models["furnace-twin"].retries_total == busy.refusals


def test_fallbacks_serve_embeddings_when_the_model_cannot(gateway_with, serve_engines, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    busy, plain, good = serve_engines(
        BusyEmbedder("furnace-busy"), PlainEmbedder("furnace-plain"), DemoEngine("furnace-good")
    )
    models = (
        ModelConfig(
            "furnace-busy",
            workers=(busy.address,),
            fallbacks=("furnace-plain", "furnace-good"),
        ),
        ModelConfig("furnace-plain", workers=(plain.address,)),
        ModelConfig("furnace-good", workers=(good.address,)),
    )
    gw = gateway_with(models=models, retry_attempts=1)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:

        def served(**body: object) -> str:
            reply = client.post(EMBEDDINGS, json={"model": "furnace-busy", "input": "x", **body})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == reply.headers["x-furnace-model"]
            return str(reply.json()["model"])

        assert served() == "furnace-plain"  # the first fallback
        # one that does not serve `dimensions` is passed over
        assert served(dimensions=4) == "furnace-good"
    assert busy.engine.refusals == 2

    def logged() -> list[tuple[str, str]]:
        lines = (json.loads(r.getMessage()) for r in caplog.records if r.name == "furnace.access")
        return [(line.get("asked_model", ""), line["model"]) for line in lines]

    wait_until(lambda: len(logged()) == 2, "both access-log lines")
    assert logged() == [("furnace-busy", "furnace-plain"), ("furnace-busy", "furnace-good")]


class HeldEmbedder(DemoEngine):
    """Embeds only after `HANG_GUARD` seconds; counts the calls cancelled before."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.entered = threading.Event()
        self.cancelled = 0

    async def embed(self, request: EmbedRequest) -> Embeddings:
        self.entered.set()
        try:
            await asyncio.sleep(HANG_GUARD)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().embed(request)


def test_a_client_that_leaves_cancels_the_worker_call(gateway_with, serve_engines):
    engine = HeldEmbedder("furnace-held")
    (server,) = serve_engines(engine)
    gw = gateway_with(models=_embedding_model("furnace-held", server.address))
    with (
        httpx.Client(base_url=gw.url, timeout=0.5) as client,
        pytest.raises(httpx.ReadTimeout),
    ):
        client.post(EMBEDDINGS, json={"model": "furnace-held", "input": "a"})
    assert engine.entered.is_set()
    wait_until(lambda: engine.cancelled == 1, "the worker's call to be cancelled")
    wait_until(lambda: gw.state.slots.in_use == 0, "the slot back")


def test_request_timeout_is_504_and_cancels_the_call(gateway_with, serve_engines):
    engine = HeldEmbedder("furnace-held")
    (server,) = serve_engines(engine)
    gw = gateway_with(models=_embedding_model("furnace-held", server.address), request_timeout=0.5)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        reply = client.post(EMBEDDINGS, json={"model": "furnace-held", "input": "a"})
    assert reply.status_code == 504
    assert reply.json()["error"]["code"] == "timeout"
    wait_until(lambda: engine.cancelled == 1, "the worker's call to be cancelled")


def test_the_drain_cancels_a_call_past_its_grace(gateway_with, serve_engines, server_loop):
    engine = HeldEmbedder("furnace-held")
    (server,) = serve_engines(engine)
    gw = gateway_with(models=_embedding_model("furnace-held", server.address))
    body = {"model": "furnace-held", "input": "a"}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        replies: list[httpx.Response] = []
        caller = threading.Thread(target=lambda: replies.append(client.post(EMBEDDINGS, json=body)))
        caller.start()
        assert engine.entered.wait(HANG_GUARD)
        server_loop.call(gw.state.inflight.drain(0.2))
        caller.join(HANG_GUARD)
        assert replies[0].status_code == 503
        assert replies[0].json()["error"]["code"] == "gateway_shutdown"
        refused = client.post(EMBEDDINGS, json=body)  # the door is shut
        assert refused.status_code == 503
    wait_until(lambda: engine.cancelled == 1, "the worker's call to be cancelled")
