"""Answers in OpenAI's shape, streamed and not, through httpx and the openai SDK."""

import anyio
import openai
import pytest

from tests.support.requests import NO_CACHE, sse_events, user
from tests.support.waiting import HANG_GUARD


def test_chat_completion_shape(client):
    response = client.post(
        "/v1/chat/completions",
        json={"model": "furnace-demo", "messages": user("the quick brown fox")},
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "furnace-demo"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "the quick brown fox"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        **NO_CACHE,
    }


def test_prompt_tokens_count_every_message(client):
    messages = [{"role": "system", "content": "be brief"}, *user("a b c")]
    body = client.post("/v1/chat/completions", json={"messages": messages}).json()
    assert body["usage"]["prompt_tokens"] == 5
    assert body["choices"][0]["message"]["content"] == "a b c"


def test_completion_shape_and_length(client):
    response = client.post(
        "/v1/completions",
        json={"model": "furnace-demo", "prompt": "one two three", "max_tokens": 2},
    )
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "one two", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        **NO_CACHE,
    }


def test_ids_are_unique(client):
    ids = {client.post("/v1/completions", json={"prompt": "x"}).json()["id"] for _ in range(20)}
    assert len(ids) == 20


def test_chat_stream_shape(client):
    response = client.post(
        "/v1/chat/completions",
        json={"model": "furnace-slow", "messages": user("a b c"), "stream": True},
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "a b c"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len(chunks) >= 4  # the slow engine sends its words one by one


def test_stream_include_usage(client):
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": user("a b c"),
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 2,
        },
    )
    chunks = sse_events(response.text)[:-1]
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        **NO_CACHE,
    }
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_completion_stream(client):
    response = client.post(
        "/v1/completions", json={"model": "furnace-slow", "prompt": "x y z", "stream": True}
    )
    chunks = sse_events(response.text)[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x y z"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_models_list(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    models = {m["id"]: m for m in body["data"]}
    assert set(models) == {"furnace-demo", "furnace-slow", "scripted", "resnet-50"}
    demo = models["furnace-demo"]
    assert demo["object"] == "model"
    assert demo["owned_by"] == "furnace"
    assert isinstance(demo["created"], int)
    assert demo["max_model_len"] == 64
    assert "max_model_len" not in models["resnet-50"]


def test_request_without_model_goes_to_the_first_model(client):
    body = client.post("/v1/completions", json={"prompt": "hi"}).json()
    assert body["model"] == "furnace-demo"


def test_unknown_model_is_404(client):
    response = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": user("x")})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert error["type"] == "invalid_request_error"


def test_tensor_model_is_not_supported(client):
    for stream in (False, True):
        response = client.post(
            "/v1/completions", json={"model": "resnet-50", "prompt": "x", "stream": stream}
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "model_not_supported"


def test_health_and_ready(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200


def test_unknown_route_and_method_are_openai_shaped(client):
    response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"  # RFC 9110 15.5.6


def test_request_id_is_returned_and_passed_to_the_worker(client, workers):
    from tests.support.scripted_worker import script

    response = client.post(
        "/v1/completions",
        json={"model": "scripted", "prompt": script(texts=1)},
        headers={
            "x-request-id": "req-abc-123",
            "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        },
    )
    assert response.headers["x-request-id"] == "req-abc-123"
    assert "req-abc-123" in workers.scripted.calls
    metadata = workers.scripted.metadata["req-abc-123"]
    assert metadata["x-request-id"] == "req-abc-123"
    assert metadata["traceparent"].startswith("00-aaaa")
    assert client.post("/v1/completions", json={"prompt": "x"}).headers["x-request-id"]


@pytest.fixture
def sdk(gateway):
    # closed after the test: an unclosed client is a cycle whose socket the collector may
    # finalize first, a ResourceWarning in whichever test it runs in
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def test_openai_sdk_sync(sdk):
    reply = sdk.chat.completions.create(
        model="furnace-demo", messages=user("hello there"), max_tokens=5
    )
    assert reply.choices[0].message.content == "hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.total_tokens == 4

    stream = sdk.chat.completions.create(
        model="furnace-slow",
        messages=user("one two three"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert chunks[-1].usage.completion_tokens == 3

    completion = sdk.completions.create(model="furnace-demo", prompt="a b c", max_tokens=2)
    assert completion.choices[0].text == "a b"
    assert completion.choices[0].finish_reason == "length"

    models = sdk.models.list()
    assert "furnace-demo" in [m.id for m in models.data]


def test_openai_sdk_errors(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="furnace-demo", messages=user("x"), temperature=3)
    assert caught.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=user("x"))
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="furnace-demo", messages=user("w " * 70), stream=True)
    assert caught.value.code == "context_length_exceeded"


def test_openai_sdk_async(gateway):
    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
        ) as sdk:
            reply = await sdk.chat.completions.create(model="furnace-demo", messages=user("a b"))
            assert reply.choices[0].message.content == "a b"
            stream = await sdk.completions.create(model="furnace-slow", prompt="x y z", stream=True)
            texts = [chunk.choices[0].text async for chunk in stream]
            assert "".join(texts) == "x y z"

            async def one(i: int) -> None:
                r = await sdk.completions.create(model="furnace-demo", prompt=f"n {i}")
                assert r.choices[0].text == f"n {i}"

            async with anyio.create_task_group() as group:
                for i in range(20):
                    group.start_soon(one, i)

    anyio.run(main)


@pytest.mark.parametrize(
    "headers",
    [
        {"x-request-id": "bad id with spaces", "traceparent": "not-a-trace"},
        {"x-request-id": "x" * 200},
        [("x-request-id", b"caf\xc3\xa9"), ("traceparent", b"00-\xff")],
    ],
)
def test_odd_request_ids_and_traceparents_are_replaced_not_fatal(client, workers, headers):
    response = client.post(
        "/v1/completions", json={"model": "scripted", "prompt": "x"}, headers=headers
    )
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert len(rid) == 32 and rid in workers.scripted.calls
    assert "traceparent" not in workers.scripted.metadata[rid]


def test_a_chat_stream_sends_its_role_chunk_with_the_first_token(client):
    # nothing is written between the headers and the first token: one write, not two
    from tests.support.scripted_worker import script

    body = {"model": "scripted", "messages": user(script(texts=2, delay=0.3)), "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        first = next(response.iter_raw())
    assert b'"delta":{"role":"assistant","content":""}' in first
    assert b'"delta":{"content":"t0 "}' in first


def test_a_chat_stream_failing_before_its_first_token_sends_its_role_chunk_first(client):
    """The role chunk held for the first token goes out before a failure that comes
    first, as it does before one after a token: the stream's head is the same."""
    from tests.support.scripted_worker import script

    body = {"model": "scripted", "messages": user(script(started=True, status="INTERNAL"))}
    answer = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert answer.status_code == 200
    role, error, done = sse_events(answer.text)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert error["error"]["code"] == "engine_error" and done == "[DONE]"
