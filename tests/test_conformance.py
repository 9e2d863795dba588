"""One conformance suite for both ways to put an engine behind the gateway: a
gRPC worker, and an OpenAI-compatible HTTP upstream (here a second
furnace-gateway serving the same demo workers)."""

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.config import ModelConfig
from tests.support.requests import sse_events
from tests.support.servers import Gateway, assert_nothing_left, make_config, start_gateway
from tests.support.waiting import HANG_GUARD, wait_until


@pytest.fixture(scope="session")
def http_fronted(server_loop, workers, gateway) -> Iterator[Gateway]:
    """A gateway whose models are served over HTTP by the shared gateway."""
    upstream = gateway.url + "/v1"
    models = tuple(
        ModelConfig(name, workers=(upstream,), upstream="openai")
        for name in ("furnace-demo", "furnace-slow")
    )
    front = start_gateway(server_loop, make_config(workers, models=models))
    yield front
    front.stop()


@pytest.fixture(params=["grpc", "openai"])
def served(request, gateway) -> Iterator[Gateway]:
    """The gateway to talk to, its models on gRPC workers or on an HTTP upstream."""
    front = gateway if request.param == "grpc" else request.getfixturevalue("http_fronted")
    yield front
    assert_nothing_left(front, None)


@pytest.fixture
def sdk(served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    )


def user(text: str) -> list:
    return [{"role": "user", "content": text}]


def test_chat_answer_and_usage(sdk):
    reply = sdk.chat.completions.create(
        model="furnace-demo",
        messages=[{"role": "system", "content": "be brief"}, *user("one two three")],
    )
    assert reply.choices[0].message.content == "one two three"
    assert reply.choices[0].finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 3)


def test_streamed_chat_with_usage(sdk):
    chunks = list(
        sdk.chat.completions.create(
            model="furnace-slow",
            messages=user("a b c d"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "a b c d"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 4)


def test_length_at_max_tokens(sdk):
    completion = sdk.completions.create(model="furnace-demo", prompt="a b c d", max_tokens=2)
    assert completion.choices[0].text == "a b"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 2


def test_stop_strings(sdk):
    completion = sdk.completions.create(
        model="furnace-demo", prompt="alpha beta STOP gamma", stop=["STOP"]
    )
    assert completion.choices[0].text == "alpha beta "
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_context_too_long_is_a_400(served, stream):
    response = httpx.post(
        served.url + "/v1/completions",
        json={"model": "furnace-demo", "prompt": "w " * 80, "stream": stream},
        timeout=HANG_GUARD,
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_bad_parameter_is_a_400(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="furnace-demo", prompt="x", top_p=0)
    assert caught.value.body["param"] == "top_p"


def test_models_list_has_the_context(served):
    models = httpx.get(served.url + "/v1/models", timeout=HANG_GUARD).json()["data"]
    demo = next(m for m in models if m["id"] == "furnace-demo")
    assert demo["max_model_len"] == 64


def test_client_leaving_stops_the_engine(served, workers):
    engine = workers.slow_engine
    aborted = engine.aborted
    body = {"model": "furnace-slow", "prompt": "w " * 200, "stream": True}
    with (
        httpx.Client(base_url=served.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        events = sse_events(next(lines) + "\n" + next(lines))
        assert events == [] or "choices" in events[0]
    wait_until(lambda: engine.aborted == aborted + 1, "the engine to stop")
