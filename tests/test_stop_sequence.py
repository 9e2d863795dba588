"""Which stop string ended an answer (Anthropic's `stop_sequence`), carried from where
the strings are matched to the edge: the matcher knows it, our workers send it in
`Finished.stop_sequence`, an OpenAI-compatible server's (vLLM's) `stop_reason` is read,
and the Messages API answers `stop_reason: "stop_sequence"` with it. A model that ends
by itself leaves it empty (`end_turn`)."""

from __future__ import annotations

import anthropic
import orjson
import pytest

from gateway.protocol.convert import event_from_proto, event_to_proto
from gateway.protocol.stop import StopMatcher
from gateway.protocol.types import Finished, FinishReason
from gateway.upstreams.openai_http.sse import _Stream
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD


def test_the_matcher_says_which_string_matched():
    matcher = StopMatcher(("END", "STOP"))
    assert matcher.feed("a b ST") == ("a b ", False) and matcher.matched == ""
    assert matcher.feed("OP c") == ("", True)
    assert matcher.matched == "STOP"


def test_the_protocol_carries_it():
    finished = Finished(FinishReason.STOP, 3, None, 1, "END")
    assert event_from_proto(event_to_proto(finished)) == finished
    plain = Finished(FinishReason.STOP, 3)
    assert event_from_proto(event_to_proto(plain)).stop_sequence == ""


@pytest.mark.parametrize(("stop_reason", "expected"), [("END", "END"), (None, ""), (128001, "")])
def test_vllms_stop_reason_is_read(stop_reason, expected):
    chunk = {
        "choices": [
            {
                "index": 0,
                "delta": {},
                "finish_reason": "stop",
                "stop_reason": stop_reason,
            }
        ]
    }
    stream = _Stream(True, 1)
    stream.feed(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
    (finished,) = list(stream.ready)
    assert finished.stop_sequence == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_message_that_met_a_stop_sequence_says_so(gateway, stream):
    ask = {
        "model": DEMO_MODEL,
        "max_tokens": 16,
        "stop_sequences": ["END", "STOP"],
        "messages": [{"role": "user", "content": "a b STOP c"}],
    }
    with anthropic.Anthropic(
        base_url=gateway.url, api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as claude:
        if stream:
            with claude.messages.stream(**ask) as events:
                message = events.get_final_message()
        else:
            message = claude.messages.create(**ask)
        ended = claude.messages.create(**{**ask, "messages": [{"role": "user", "content": "a b"}]})
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    assert message.content[0].text == "a b "
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)
