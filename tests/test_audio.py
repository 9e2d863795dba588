"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` through the gateway, read
with the official openai SDK and httpx: against vLLM's own OpenAI server serving a tiny
Whisper (its CPU build: tests/support/tiny_whisper.py, which writes one word again and
again), each answer compared with what vLLM answers the same form directly, whole, as
text, verbose, and streamed (as OpenAI's events); against our small OpenAI-compatible
server (tests/support/openai_server.py), OpenAI's own stream read and relayed, the form
as the server receives it, and a stream that breaks after its head. Every refusal names
its field. After each test nothing is left in the gateway (and vLLM is idle).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.config import Config, ModelConfig
from gateway.worker.demo import DEMO_MODEL
from tests.support.conformance import vllm_metric
from tests.support.keys import bearer, keyed, new_key
from tests.support.metrics import access_lines, scrape, value
from tests.support.openai_server import OpenAIServer, keyed_plain
from tests.support.servers import Gateway, assert_nothing_left, start_gateway
from tests.support.tiny_whisper import WORD, build_tiny_whisper, wav
from tests.support.vllm import VllmProcess, start_lean_http_server
from tests.support.waiting import HANG_GUARD, wait_until

WHISPER = "tiny-whisper"
#: The model served by our OpenAI-compatible server, as OpenAI's API answers.
HOSTED = "hosted-transcribe"
KEY_ENV = "FURNACE_TEST_AUDIO_KEY"
TRANSCRIPTIONS = "/v1/audio/transcriptions"
AUDIO = wav()
#: The most bytes of audio the test gateway takes.
MAX_AUDIO = 256 * 1024
#: Every SDK request's: the gateway takes forms only with a key header (any value here).
KEYED = {"authorization": "Bearer unused"}


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM's OpenAI server serving the tiny Whisper."""
    model = build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))
    server = start_lean_http_server(model, tmp_path_factory.mktemp("vllm-speech-logs"), WHISPER)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hosted(server_loop) -> Iterator[OpenAIServer]:
    """Our OpenAI-compatible server, plain HTTP, with a key of its own."""
    with keyed_plain(server_loop, HOSTED, KEY_ENV, "hello from the fleet") as server:
        yield server


@pytest.fixture(scope="module")
def front(server_loop, speech: VllmProcess, hosted: OpenAIServer, workers) -> Iterator[Gateway]:
    """A gateway with vLLM's speech server, our OpenAI-compatible server and a demo worker."""
    models = (
        ModelConfig(WHISPER, workers=(f"http://127.0.0.1:{speech.port}/v1",), upstream="openai"),
        ModelConfig(HOSTED, workers=(hosted.url,), upstream="openai", api_key_env=KEY_ENV),
        ModelConfig(DEMO_MODEL, workers=(workers.demo.address,)),
    )
    config = Config(
        host="127.0.0.1", port=0, log_level="warning", models=models, max_audio_bytes=MAX_AUDIO
    )
    gw = start_gateway(server_loop, config)
    yield gw
    gw.stop()


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=HANG_GUARD)


@pytest.fixture
def through(front: Gateway, speech: VllmProcess) -> Iterator[openai.OpenAI]:
    """The SDK through the gateway; after the test, nothing left in it, vLLM idle."""
    with sdk(front.url + "/v1") as client:
        yield client
    assert_nothing_left(front, None)
    running = lambda: vllm_metric(speech.port, "vllm:num_requests_running")  # noqa: E731
    wait_until(lambda: running() == 0, "vLLM to be idle")


@pytest.fixture
def direct(speech: VllmProcess) -> Iterator[openai.OpenAI]:
    """The SDK straight to vLLM, for the same forms."""
    with sdk(f"http://127.0.0.1:{speech.port}/v1") as client:
        yield client


@pytest.fixture
def http(front: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=front.url, timeout=HANG_GUARD, headers=KEYED) as client:
        yield client
    assert_nothing_left(front, None)


def both(through: openai.OpenAI, direct: openai.OpenAI, **form: Any) -> tuple[Any, Any]:
    """The gateway's transcription and vLLM's own of one form."""
    request = {"model": WHISPER, "file": ("tone.wav", AUDIO, "audio/wav"), **form}
    return (
        through.audio.transcriptions.create(**request),
        direct.audio.transcriptions.create(**request),
    )


# -- through vLLM ------------------------------------------------------------------


def test_a_transcription_is_vllms_own(through, direct):
    ours, theirs = both(through, direct, language="en", extra_body={"max_completion_tokens": 5})
    assert ours.text == theirs.text == WORD * 5
    assert ours.model_extra == theirs.model_extra  # its usage: the audio's seconds


def test_text_and_verbose_json_are_vllms_own_and_text_is_plain_text(through, direct, http):
    limit = {"max_completion_tokens": 3}
    ours, theirs = both(through, direct, response_format="text", extra_body=limit)
    # vLLM writes a text answer as JSON; the gateway answers the text, as OpenAI does
    assert ours == WORD * 3
    assert ours in theirs
    raw = http.post(
        TRANSCRIPTIONS,
        files={"file": ("tone.wav", AUDIO, "audio/wav")},
        data={"model": WHISPER, "response_format": "text", "max_completion_tokens": "3"},
    )
    assert raw.headers["content-type"].startswith("text/plain")
    assert raw.text == WORD * 3
    assert raw.headers["x-furnace-model"] == WHISPER
    # verbose: vLLM decodes with timestamps (the tiny model's text then differs)
    ours, theirs = both(
        through, direct, response_format="verbose_json", language="en", extra_body=limit
    )
    assert ours.model_dump() == theirs.model_dump()
    assert ours.language == "en"
    assert ours.duration == theirs.duration == pytest.approx(1.5)


def test_a_translation_is_vllms_own(through, speech, http):
    # the SDK's translations are deprecated (a warning, an error here): a plain form
    form = {"model": WHISPER, "max_completion_tokens": "4"}
    files = {"file": ("tone.wav", AUDIO, "audio/wav")}
    ours = http.post("/v1/audio/translations", data=form, files=files)
    theirs = httpx.post(
        f"http://127.0.0.1:{speech.port}/v1/audio/translations",
        data=form,
        files=files,
        timeout=HANG_GUARD,
    )
    assert ours.status_code == theirs.status_code == 200
    assert ours.json() == theirs.json()
    assert ours.json()["text"] == WORD * 4


def test_a_stream_is_openais_events_of_vllms_text(through, direct):
    request = {
        "model": WHISPER,
        "file": ("tone.wav", AUDIO, "audio/wav"),
        "language": "en",
        "extra_body": {"max_completion_tokens": 6},
    }
    whole = direct.audio.transcriptions.create(**request)
    request["extra_body"]["stream_include_usage"] = True
    events = list(through.audio.transcriptions.create(stream=True, **request))
    *deltas, done = events
    assert {e.type for e in deltas} == {"transcript.text.delta"}
    assert "".join(e.delta for e in deltas) == whole.text == WORD * 6
    assert done.type == "transcript.text.done"
    assert done.text == whole.text
    # vLLM's usage chunk: the prompt's tokens (the decoder's 4 and the audio's) and 6 written
    assert done.usage.output_tokens == 6
    assert done.usage.input_tokens > 4
    assert done.usage.total_tokens == done.usage.input_tokens + 6


def test_vllms_own_refusal_reaches_the_client(through):
    with pytest.raises(openai.BadRequestError) as refused:
        through.audio.transcriptions.create(
            model=WHISPER, file=("tone.wav", AUDIO, "audio/wav"), response_format="srt"
        )
    assert "response_format" in refused.value.message


def test_the_usage_is_recorded_in_the_access_log_and_metrics(front, through, caplog):
    request = {
        "model": WHISPER,
        "file": ("tone.wav", AUDIO, "audio/wav"),
        "extra_body": {"max_completion_tokens": 2, "stream_include_usage": True},
    }
    caplog.set_level("INFO", logger="furnace.access")
    before = scrape(front.url)
    *_, done = through.audio.transcriptions.create(stream=True, **request)
    wait_until(lambda: access_lines(caplog), "the access-log line")
    (line,) = access_lines(caplog)
    assert line["route"] == TRANSCRIPTIONS
    assert (line["model"], line["status"], line["outcome"]) == (WHISPER, 200, "completed")
    assert line["stream"] is True
    assert line["prompt_tokens"] == done.usage.input_tokens
    assert line["completion_tokens"] == 2
    labels = {"model": WHISPER, "route": TRANSCRIPTIONS, "outcome": "completed", "status": "200"}
    after = scrape(front.url)
    name = "furnace_gateway_requests_total"
    assert value(after, name, **labels) == value(before, name, **labels) + 1


# -- an OpenAI-shaped server ---------------------------------------------------------


def test_openais_own_stream_and_whole_answer_are_relayed(front, hosted, http):
    with sdk(front.url + "/v1") as client:
        whole = client.audio.transcriptions.create(
            model=HOSTED,
            file=("talk.mp3", b"ID3 not really mp3", "audio/mpeg"),
            language="fr",
            prompt="a fleet",
            temperature=0.2,
            timestamp_granularities=["word", "segment"],
            response_format="verbose_json",
        )
        assert whole.text == "hello from the fleet"
        # the form as the server got it: the file and every field, in order
        assert hosted.last_audio == b"ID3 not really mp3"
        assert hosted.last_form == {
            "model": [HOSTED],
            "language": ["fr"],
            "prompt": ["a fleet"],
            "response_format": ["verbose_json"],
            "temperature": ["0.2"],
            "timestamp_granularities[]": ["word", "segment"],
        }
        events = list(
            client.audio.transcriptions.create(
                model=HOSTED, file=("talk.wav", AUDIO, "audio/wav"), stream=True
            )
        )
    assert [e.type for e in events] == ["transcript.text.delta"] * 4 + ["transcript.text.done"]
    assert "".join(e.delta for e in events[:-1]) == "hello from the fleet"
    assert events[-1].usage.input_tokens == 7
    assert events[-1].usage.output_tokens == 4
    assert_nothing_left(front, None)


#: A streamed transcription of the OpenAI-shaped server's.
STREAMED: dict[str, Any] = {
    "files": {"file": ("talk.wav", AUDIO, "audio/wav")},
    "data": {"model": HOSTED, "stream": "true"},
}


def streamed(http: httpx.Client) -> httpx.Response:
    """The OpenAI-shaped server's transcription, streamed, read whole."""
    return http.post(TRANSCRIPTIONS, **STREAMED)


def data_of(response: httpx.Response) -> list[str]:
    """A stream's `data:` payloads, in order."""
    return [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]


def test_a_stream_that_breaks_after_its_head_ends_with_an_error_event(front, hosted, http):
    hosted.break_after = 2
    try:
        broken = streamed(http)
    finally:
        hosted.break_after = None
    assert broken.status_code == 200
    events = data_of(broken)
    assert events[:2] == [
        '{"type":"transcript.text.delta","delta":"hello"}',
        '{"type":"transcript.text.delta","delta":" from"}',
    ]
    assert '"error"' in events[2]
    assert events[3] == "[DONE]"


def test_a_stream_answered_whole_is_one_done_event(front, hosted, http):
    hosted.whole_streams = True
    try:
        whole = streamed(http)
    finally:
        hosted.whole_streams = False
    assert whole.status_code == 200
    assert whole.headers["content-type"].startswith("text/event-stream")
    done, end = data_of(whole)
    assert json.loads(done) == {
        "type": "transcript.text.done",
        "text": "hello from the fleet",
        "usage": {"type": "tokens", "input_tokens": 7, "output_tokens": 4, "total_tokens": 11},
    }
    assert end == "[DONE]"


def test_a_transcription_needs_room_in_its_budgets_and_is_charged_what_it_used(
    gateway_with, hosted
):
    """A transcription reserves one token (its audio's tokens are known only to its
    server): admitted while its team's budget has that room, charged the tokens the
    server says (here 7 read, 4 written), refused once the budget is spent."""
    key = new_key("alpha")
    model = {"name": HOSTED, "upstream": "openai", "workers": [hosted.url], "api_key_env": KEY_ENV}
    budget = {"alpha": {"budgets": [{"window": "day", "tokens": 12}]}}
    gw = gateway_with(**keyed(budget, {key: "alpha"}, models=[model]))
    used = gw.state.teams.accounts.budgets.used
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as client:
        assert streamed(client).status_code == 200
        wait_until(lambda: list(used.values()) == [11], "the stream's tokens charged")
        assert streamed(client).status_code == 200  # one token of room left: admitted
        wait_until(lambda: list(used.values()) == [22], "the second stream's tokens charged")
        spent = streamed(client)
    assert spent.status_code == 429, spent.text
    assert spent.json()["error"]["code"] == "budget_exceeded"


def test_a_client_that_leaves_mid_stream_ends_the_call(front, hosted, http):
    hosted.pace = 0.5
    try:
        with http.stream("POST", TRANSCRIPTIONS, **STREAMED) as response:
            first = next(response.iter_lines())
            assert first == 'data: {"type":"transcript.text.delta","delta":"hello"}'
        # the client left with three events to come: the gateway's call ends now
        assert_nothing_left(front, None)
    finally:
        hosted.pace = 0.0


def test_the_request_timeout_bounds_a_transcription(server_loop, hosted):
    model = ModelConfig(HOSTED, workers=(hosted.url,), upstream="openai", api_key_env=KEY_ENV)
    config = Config(
        host="127.0.0.1", port=0, log_level="warning", models=(model,), request_timeout=0.5
    )
    gw = start_gateway(server_loop, config)
    hosted.pace = 1.0
    try:
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=KEYED) as client:
            slow = streamed(client)
        assert slow.status_code == 200  # its head left with the first word
        events = data_of(slow)
        assert '"code":"timeout"' in events[-2]
        assert events[-1] == "[DONE]"
        assert_nothing_left(gw, None)
    finally:
        hosted.pace = 0.0
        gw.stop()


# -- refusals ----------------------------------------------------------------------


def post(http: httpx.Client, data: dict[str, Any], files: Any = None) -> httpx.Response:
    if files is None:
        files = {"file": ("tone.wav", AUDIO, "audio/wav")}
    return http.post(TRANSCRIPTIONS, data=data, files=files)


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"model": WHISPER, "temperature": "1.5"}, "temperature"),
        ({"model": WHISPER, "temperature": "warm"}, "temperature"),
        ({"model": WHISPER, "response_format": "mp3"}, "response_format"),
        ({"model": WHISPER, "timestamp_granularities[]": "line"}, "timestamp_granularities[]"),
        ({"model": WHISPER, "stream": "yes"}, "stream"),
        ({"model": WHISPER, "top_k": "-2"}, "top_k"),
        ({"model": WHISPER, "max_completion_tokens": "0"}, "max_completion_tokens"),
        ({"model": WHISPER, "seed": "1.5"}, "seed"),
        ({"model": WHISPER, "include[]": "logprobs"}, "include[]"),
        ({"model": WHISPER, "chunking_strategy": "auto"}, "chunking_strategy"),
        ({"model": WHISPER, "vllm_xargs": "{}"}, "vllm_xargs"),
        ({"model": WHISPER, "colour": "blue"}, "colour"),
        ({"model": WHISPER, "language": ["en", "fr"]}, "language"),
        ({"model": DEMO_MODEL}, "model"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(http, data, param):
    refused = post(http, data)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param


def test_the_file_is_required_single_not_empty_and_bounded(http):
    missing = http.post(TRANSCRIPTIONS, data={"model": WHISPER}, files={"other": ("x", b"x")})
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "file"
    empty = post(http, {"model": WHISPER}, {"file": ("tone.wav", b"", "audio/wav")})
    assert empty.status_code == 400
    assert empty.json()["error"]["param"] == "file"
    two = post(http, {"model": WHISPER}, [("file", ("a.wav", AUDIO)), ("file", ("b.wav", AUDIO))])
    assert two.status_code == 400
    assert two.json()["error"]["param"] == "file"
    large = post(http, {"model": WHISPER}, {"file": ("big.wav", b"\0" * (MAX_AUDIO + 1))})
    assert large.status_code == 413
    assert large.json()["error"]["param"] == "file"
    huge = post(http, {"model": WHISPER}, {"file": ("huge.wav", b"\0" * (MAX_AUDIO + 128 * 1024))})
    assert huge.status_code == 413  # the body, refused from its Content-Length


def test_a_body_that_is_not_a_keyed_form_is_refused(front, http):
    as_json = http.post(TRANSCRIPTIONS, json={"model": WHISPER, "file": "tone.wav"})
    assert as_json.status_code == 400
    assert "multipart/form-data" in as_json.json()["error"]["message"]
    with httpx.Client(base_url=front.url, timeout=HANG_GUARD) as bare:
        no_key = bare.post(
            TRANSCRIPTIONS, data={"model": WHISPER}, files={"file": ("tone.wav", AUDIO)}
        )
    assert no_key.status_code == 415
    assert "API key" in no_key.json()["error"]["message"]
    broken = http.post(
        TRANSCRIPTIONS,
        content=b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\n' + WHISPER.encode(),
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert broken.status_code == 400  # a form cut short: never a 500


def test_a_form_of_too_many_parts_is_refused_at_the_first_past_the_bound(http):
    # 300,000 one-byte fields (18 MB) took 6.7 s of the event loop to parse, unbounded
    part = b'--b\r\nContent-Disposition: form-data; name="a"\r\n\r\nx\r\n'
    refused = http.post(
        TRANSCRIPTIONS,
        content=part * 3_000 + b"--b--\r\n",  # within the test gateway's 256 KiB
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "A form has at most 64 parts."


def test_an_unknown_model_is_a_404(http):
    refused = post(http, {"model": "no-such-model"})
    assert refused.status_code == 404
