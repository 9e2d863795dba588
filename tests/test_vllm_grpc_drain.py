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
) -> tuple[list[Event], bool, int]:
    """A greedy answer's events through a pump from a stand-in engine at `target` (its port
    filled in), `per_chunk` tokens a message after the first; whether the pump was ever
    full, and how many pumps read by a task."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(
        FakeVllm(ids, [], 0.0, per_chunk, (str(model_dir), MODEL)), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = VllmGrpcUpstream(target % port, model=MODEL, tokenizer=str(model_dir))
    sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
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
