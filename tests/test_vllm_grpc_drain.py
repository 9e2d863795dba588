"""The vLLM gRPC upstream's push path, where a read's plain texts go to the pump in one
call (`VllmGrpcCall.drain`) and the rest through `poll`: against the engine stand-in of
`benchmarks/fake_vllm_grpc.py` (one token a message, sent as fast as it can, so reads
carry many), served by grpc.aio on loopback. The events are those of the same call read
by a task (a grpc.aio stream, a `dns:///` target), one `Text` a message; with a small
buffer bound the pump stops taking at it and the answer still arrives whole."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from benchmarks.fake_vllm_grpc import TEXT, FakeVllm
from gateway.admission.pump import EventPump, Phase
from gateway.protocol.types import Event, Finished, GenerateRequest, SamplingParams, Started, Text
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from tests.support.servers import ServerLoop
from tests.support.vllm import build_vllm_model
from tests.support.waiting import HANG_GUARD

MODEL = "stand-in"
TOKENS = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("drain") / "model")


async def _answer(
    model_dir: Path,
    target: str,
    buffer_chars: int,
    stop: tuple[str, ...] = (),
    per_chunk: int = 1,
    ids: list[int] | None = None,
    min_tokens: int | None = None,
) -> tuple[list[Event], bool, int]:
    """A greedy answer's events through a pump from a stand-in engine at `target` (its port
    filled in), `per_chunk` tokens a message after the first (`ids`, else `TOKENS` of
    `TEXT`'s); whether the pump was ever full, and how many pumps read by a task."""
    tokens = TOKENS if ids is None else len(ids)
    if ids is None:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(
        FakeVllm(ids, [], 0.0, per_chunk, (str(model_dir), MODEL)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = VllmGrpcUpstream(target % port, model=MODEL, tokenizer=str(model_dir))
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, min_tokens=min_tokens)
    request = GenerateRequest(model=MODEL, prompt="hello", sampling=sampling, stop=stop)
    call = upstream.call(request, timeout=HANG_GUARD)

    async def start() -> tuple[Started, Any]:
        return await anext(call), call

    pump = EventPump(start(), buffer_chars=buffer_chars)
    events: list[Event] = []
    full, reading = False, -1
    try:
        while not any(isinstance(event, Finished) for event in events):
            events += await pump.next_batch(HANG_GUARD)
            if reading < 0:
                reading = EventPump.reading
            await asyncio.sleep(0.002)  # the engine sends meanwhile: reads of many messages
            full = full or pump.phase is Phase.FULL
    finally:
        await pump.aclose()
        await upstream.close()
        await server.stop(None)
    return events, full, reading


@pytest.mark.parametrize("buffer_chars", [1 << 20, 16])
def test_a_reads_texts_drained_are_the_events_a_task_reads(
    server_loop: ServerLoop, model_dir: Path, buffer_chars: int
) -> None:
    pushed, full, readers = server_loop.call(_answer(model_dir, "127.0.0.1:%d", buffer_chars))
    assert readers == 0  # pushed: our own HTTP/2 client, drained in its callback
    read, _, readers = server_loop.call(_answer(model_dir, "dns:///127.0.0.1:%d", buffer_chars))
    assert readers == 1  # a grpc.aio stream, read by a task, a message at a time
    assert pushed == read
    assert isinstance(pushed[0], Started) and isinstance(pushed[-1], Finished)
    texts = [event for event in pushed if isinstance(event, Text)]
    assert pushed[-1].completion_tokens == TOKENS
    # every token came in a chunk; the `complete` repeats the last one's, unread
    assert sum(text.tokens for text in texts) == TOKENS
    assert len(texts) > TOKENS // 2  # a Text a message (a character's pieces held)
    assert full == (buffer_chars == 16)  # the bound held the pump back, and it went on


def test_a_stop_string_ends_the_answer_as_when_read_by_a_task(
    server_loop: ServerLoop, model_dir: Path
) -> None:
    """A choice with a stop string is not plain: `poll` takes it, drain stays out."""
    stop = ("one token",)
    pushed, _, _ = server_loop.call(_answer(model_dir, "127.0.0.1:%d", 1 << 20, stop))
    read, _, _ = server_loop.call(_answer(model_dir, "dns:///127.0.0.1:%d", 1 << 20, stop))
    assert pushed == read
    end = pushed[-1]
    assert isinstance(end, Finished) and end.stop_sequence == "one token"
    text = "".join(event.text for event in pushed if isinstance(event, Text))
    assert text == TEXT[: TEXT.index("one token")]


@pytest.mark.parametrize("target", ["127.0.0.1:%d", "dns:///127.0.0.1:%d"])
def test_at_a_stop_string_tokens_after_the_one_that_completed_it_are_not_counted(
    server_loop: ServerLoop, model_dir: Path, target: str
) -> None:
    """vLLM's engine puts several tokens in a message when its steps outrun the stream
    (its outputs merge while the server is busy); at a stop string its own server counts
    the tokens up to the one whose text completed it, the rest of that message dropped,
    and so does the gateway: `completion_tokens` as vLLM's HTTP server gives it."""
    stop = "one token"
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    needed = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    # a message (the first token alone, then `per_chunk` a message) that goes on past it
    per_chunk = next(n for n in (4, 5, 6) if (needed - 1) % n)
    events, _, _ = server_loop.call(_answer(model_dir, target, 1 << 20, (stop,), per_chunk))
    end = events[-1]
    assert isinstance(end, Finished) and end.stop_sequence == stop
    assert end.completion_tokens == needed
    assert sum(event.tokens for event in events if isinstance(event, Text)) <= needed
    text = "".join(event.text for event in events if isinstance(event, Text))
    assert text == TEXT[: TEXT.index(stop)]


@pytest.mark.parametrize(
    "choice",
    [
        {},  # plain: each message's ids to the detokenizer at once
        {"min_tokens": 1},  # through the stop strings and the parser, none of them given
        {"stop": ("never said",)},  # each id of a message on its own (where a stop ends)
    ],
)
def test_an_answer_of_several_tokens_a_message_reads_as_vllm_steps_its_detokenizer(
    server_loop: ServerLoop, model_dir: Path, choice: dict[str, Any]
) -> None:
    """vLLM's detokenizer steps its DecodeStream a token at a time, whatever a message holds:
    a message that ends in a character's first bytes gives the characters before it at once,
    and an answer that ends in them drops them for good (vLLM's text is what its stream
    released); the gateway's text is the same, never a U+FFFD of its own at the end."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    whole = tokenizer.encode("one 日本語 two 語 three 日本", add_special_tokens=False).ids
    ids = whole[:-2]  # the last character's first byte
    stream = DecodeStream(skip_special_tokens=True)
    expected = "".join(stream.step(tokenizer, i) or "" for i in ids)  # as vLLM's
    assert expected == "one 日本語 two 語 three 日"
    events, _, _ = server_loop.call(
        _answer(model_dir, "127.0.0.1:%d", 1 << 20, per_chunk=4, ids=ids, **choice)
    )
    assert "".join(event.text for event in events if isinstance(event, Text)) == expected
    end = events[-1]
    assert isinstance(end, Finished) and end.completion_tokens == len(ids)


def _twice(model_dir: Path, step: float, **asked: Any) -> tuple[list[Event], list[Event]]:
    """The events of the same request (`asked`: its sampling and stop strings; its prompt
    `TEXT` twice) sent twice to a stand-in that takes `step` seconds a message."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids

    async def twice() -> tuple[list[Event], list[Event]]:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(
            FakeVllm(ids, [], step, 1, (str(model_dir), MODEL)), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        upstream = VllmGrpcUpstream(f"127.0.0.1:{port}", model=MODEL, tokenizer=str(model_dir))
        request = GenerateRequest(model=MODEL, prompt=TEXT * 2, **asked)
        answers = []
        try:
            for _ in range(2):
                call = upstream.call(request, timeout=HANG_GUARD)
                answers.append([event async for event in call])
        finally:
            await upstream.close()
            await server.stop(None)
        return answers[0], answers[1]

    return asyncio.run(twice())


def test_a_prompt_sent_again_reports_the_engines_cached_tokens(model_dir: Path):
    """vLLM says a prompt's cached tokens on each message and at its end: the stand-in
    holds the whole blocks of a prompt it saw, so the second call of the same one has
    them, in `Started` (when the engine's first message came before it went out) and
    in `Finished` (always: a `Started` sent before that message could not say them)."""
    first, second = _twice(model_dir, 0.0, sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    prompt = first[0].prompt_tokens if isinstance(first[0], Started) else 0
    cached = prompt // 16 * 16
    assert cached >= 32
    assert isinstance(first[0], Started) and first[0].cached_tokens == 0
    assert isinstance(first[-1], Finished) and first[-1].cached_tokens == 0
    assert isinstance(second[0], Started) and second[0].cached_tokens in (0, cached)
    assert isinstance(second[-1], Finished) and second[-1].cached_tokens == cached


def test_a_stop_string_after_a_late_first_message_still_reports_the_cached_tokens(
    model_dir: Path,
):
    """An engine slower than `HEAD_GRACE` to its first message gets `Started` sent without
    its counts; when the gateway's own stop string then ends the answer, the engine's end
    never comes, so `Finished` carries the cached count its first message said."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stop = tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False).ids[2:4])
    # a step of 20 ms: each first message comes after HEAD_GRACE (5 ms)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    first, second = _twice(model_dir, 0.02, sampling=sampling, stop=(stop,))
    assert isinstance(second[0], Started) and second[0].cached_tokens == 0  # not known yet
    end = second[-1]
    assert isinstance(end, Finished) and end.stop_sequence == stop
    assert end.completion_tokens < 16  # the stop string ended it, not the engine
    assert end.cached_tokens is not None and end.cached_tokens >= 32
    assert isinstance(first[-1], Finished) and first[-1].cached_tokens == 0
