"""Chats with sounds and videos in them: OpenAI's `input_audio` content parts (base64
data and its format), vLLM's `audio_url` and `video_url` parts, through the gateway to
an OpenAI-compatible server, read with the official openai SDK and httpx. Against vLLM's
own OpenAI server serving a tiny audio LLM (its CPU build: tests/support/tiny_audio_lm.py,
a Qwen2-Audio of random weights), each answer compared with what vLLM answers the same
chat directly: the same text and the same `usage.prompt_tokens`, which count the sound's
tokens, so a sound lost on the way would show. Against our OpenAI-compatible server, the
parts as the server receives them (videos too). Models whose workers cannot take a sound
or a video (the worker protocol and vLLM's gRPC server have no field for one) refuse it by
name, as every malformed part is refused. After each test nothing is left in the gateway.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Config, ModelConfig
from gateway.worker.demo import DEMO_MODEL
from tests.support.openai_server import OpenAIServer, keyed_plain
from tests.support.servers import Gateway, assert_nothing_left, start_gateway
from tests.support.tiny_audio_lm import build_tiny_audio_lm
from tests.support.tiny_whisper import wav
from tests.support.vllm import MAX_MODEL_LEN, VllmProcess, start_lean_http_server
from tests.support.waiting import HANG_GUARD

#: vLLM's engines start in the first test's setup (tens of seconds on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

HEARS = "tiny-audio-lm"
HOSTED = "hosted-audio"
KEY_ENV = "FURNACE_TEST_AUDIO_CHAT_KEY"
#: A second of a tone, as OpenAI's `input_audio` takes it.
SOUND = base64.b64encode(wav(1.0)).decode()
INPUT_AUDIO = {"type": "input_audio", "input_audio": {"data": SOUND, "format": "wav"}}
AUDIO_URL = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{SOUND}"}}
VIDEO_URL = {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}}
QUESTION = {"type": "text", "text": "what do you hear"}


@pytest.fixture(scope="module")
def hearing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM's OpenAI server serving the tiny audio LLM."""
    model = build_tiny_audio_lm(tmp_path_factory.mktemp("tiny-audio-lm"))
    logs = tmp_path_factory.mktemp("vllm-audio-lm-logs")
    server = start_lean_http_server(model, logs, HEARS, MAX_MODEL_LEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hosted(server_loop) -> Iterator[OpenAIServer]:
    """Our OpenAI-compatible server, plain HTTP, with a key of its own."""
    with keyed_plain(server_loop, HOSTED, KEY_ENV, "a tone") as server:
        yield server


@pytest.fixture(scope="module")
def front(server_loop, hearing: VllmProcess, hosted: OpenAIServer, workers) -> Iterator[Gateway]:
    """A gateway with vLLM's audio LLM, our OpenAI-compatible server and a demo worker."""
    models = (
        ModelConfig(HEARS, workers=(f"http://127.0.0.1:{hearing.port}/v1",), upstream="openai"),
        ModelConfig(HOSTED, workers=(hosted.url,), upstream="openai", api_key_env=KEY_ENV),
        ModelConfig(DEMO_MODEL, workers=(workers.demo.address,)),
    )
    gw = start_gateway(server_loop, Config(host="127.0.0.1", port=0, models=models))
    yield gw
    gw.stop()


@pytest.fixture
def through(front: Gateway, workers) -> Iterator[openai.OpenAI]:
    """The SDK through the gateway; after the test, nothing left in it."""
    with openai.OpenAI(
        base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client
    assert_nothing_left(front, workers)


@pytest.fixture
def http(front: Gateway, workers) -> Iterator[httpx.Client]:
    """httpx to the gateway; after the test, nothing left in it."""
    with httpx.Client(base_url=front.url, timeout=HANG_GUARD) as client:
        yield client
    assert_nothing_left(front, workers)


def chat(*parts: dict[str, Any], model: str = HEARS, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [*parts, QUESTION]}],
        "max_tokens": 5,
        "temperature": 0,
        **extra,
    }


def direct(server: VllmProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    """vLLM's own answer to `body` at `path`."""
    return httpx.post(f"http://127.0.0.1:{server.port}{path}", json=body, timeout=HANG_GUARD)


def answered(server: VllmProcess, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own chat completion of `body`."""
    answer = direct(server, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


@pytest.mark.parametrize("part", [INPUT_AUDIO, AUDIO_URL], ids=["input_audio", "audio_url"])
def test_a_chat_with_a_sound_is_answered_as_vllm_answers_it(through, hearing, part):
    body = chat(part)
    own = answered(hearing, body)
    answer = through.chat.completions.create(**body)
    assert answer.choices[0].message.content == own["choices"][0]["message"]["content"]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == own["usage"]["prompt_tokens"]
    # the sound is there: the same chat without it is shorter by its tokens (~25 a second)
    silent = answered(hearing, chat())
    assert own["usage"]["prompt_tokens"] > silent["usage"]["prompt_tokens"] + 10


def test_a_streamed_chat_with_a_sound(through, hearing):
    body = chat(INPUT_AUDIO)
    own = answered(hearing, body)
    stream = through.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == own["choices"][0]["message"]["content"]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == own["usage"]["prompt_tokens"]


def test_sounds_an_image_and_a_video_keep_their_order_to_the_server(through, hosted):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    parts = [AUDIO_URL, QUESTION, image, INPUT_AUDIO, VIDEO_URL]
    body = {"model": HOSTED, "messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    answer = through.chat.completions.create(**body)
    assert answer.choices[0].message.content == "a tone"
    assert hosted.last_body["messages"] == [{"role": "user", "content": parts}]


def test_a_sound_vllm_cannot_decode_is_its_400(http, hearing):
    noise = {"type": "input_audio", "input_audio": {"data": "bm90IGEgc291bmQ=", "format": "wav"}}
    body = chat(noise)
    own = direct(hearing, "/v1/chat/completions", body)
    assert own.status_code == 400
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == own.json()["error"]["message"]


def test_the_tokens_of_a_chat_with_a_sound_are_vllms(http, hearing):
    body = {"model": HEARS, "messages": chat(INPUT_AUDIO)["messages"]}
    own = direct(hearing, "/tokenize", body)
    answer = http.post("/tokenize", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["tokens"] == own.json()["tokens"]
    silent = http.post("/tokenize", json={"model": HEARS, "messages": chat()["messages"]})
    assert answer.json()["count"] > silent.json()["count"] + 10


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    ("part", "feature"),
    [(INPUT_AUDIO, "input_audio"), (AUDIO_URL, "input_audio"), (VIDEO_URL, "video_url")],
    ids=["input_audio", "audio_url", "video_url"],
)
def test_a_model_on_the_worker_protocol_refuses_a_sound_or_a_video_by_name(
    http, path, part, feature
):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [QUESTION, part]},
    ]
    answer = http.post(path, json={"model": DEMO_MODEL, "messages": messages})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages[1].content[1]"
    assert error["message"] == f"The model `{DEMO_MODEL}` does not support '{feature}'."


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_audio"}, "input_audio"),
        ({"type": "input_audio", "input_audio": "UklGRg=="}, "input_audio"),
        ({"type": "input_audio", "input_audio": {"format": "wav"}}, "input_audio.data"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio.data"),
        (
            {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}},
            "input_audio.data",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
            "input_audio.data",
        ),
        ({"type": "input_audio", "input_audio": {"data": SOUND}}, "input_audio.format"),
        (
            {"type": "input_audio", "input_audio": {"data": SOUND, "format": "wav;x=1"}},
            "input_audio.format",
        ),
        ({"type": "audio_url", "audio_url": {"url": "file:///etc/passwd"}}, "audio_url"),
        ({"type": "audio_url", "audio_url": {"url": "data:image/png;base64,AAAA"}}, "audio_url"),
        ({"type": "audio_url"}, "audio_url"),
        ({"type": "video_url", "video_url": {"url": "data:audio/wav;base64,AAAA"}}, "video_url"),
        ({"type": "video_url", "video_url": {"url": "file:///dev/video0"}}, "video_url"),
        ({"type": "video_url", "video_url": {}}, "video_url"),
        ({"type": "input_video", "input_video": {}}, ""),
    ],
)
def test_a_malformed_sound_is_refused_by_name(http, part, param):
    answer = http.post("/v1/chat/completions", json=chat(part))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages[0].content[0]" + (f".{param}" if param else "")


def test_at_most_64_sounds_and_videos_a_request(http):
    body = chat(*[INPUT_AUDIO, VIDEO_URL] * 32, model=HOSTED)
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    body = chat(*[INPUT_AUDIO, VIDEO_URL] * 32, AUDIO_URL, model=HOSTED)
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages[0].content"
    assert "64 sounds and videos" in answer.json()["error"]["message"]
