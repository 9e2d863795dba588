"""A request's n choices through the vLLM gRPC upstream (`upstream: vllm-grpc`), against a
stand-in engine that sends their messages in an order of its own: the gateway relays each
message as it comes, in the engine's order, holding no choice behind another, and each
choice ends with its own `Finished`.

The stand-in goes in lockstep: it sends a message only once the one before has come out of
the upstream as an event, so a gateway that held a choice's text until another's end (or
until the answer's) would wait forever here and fail at the hang guard. vLLM's own order
is its scheduler's: with a reader slower than its steps it merges a choice's outputs into
one message, so a real engine's stream may carry the choices one after another
(tests/test_vllm_grpc_surface.py checks the rest against it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from benchmarks.fake_vllm_grpc import FakeVllm
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
    Text,
)
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream
from tests.support.servers import ServerLoop
from tests.support.vllm import build_vllm_model
from tests.support.waiting import HANG_GUARD, until

MODEL = "stand-in"
#: The engine's messages: (choice, token) in the order it sends them, never sorted by
#: choice; then the choices' ends, in `ENDS`' order.
ORDER = [2, 0, 1, 1, 2, 0, 0, 1, 2]
ENDS = [1, 2, 0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vllm_model(tmp_path_factory.mktemp("choices") / "model")


class Lockstep(FakeVllm):
    """Sends one token a message for the choices in `ORDER`, each message once the events
    of the ones before have come out of the upstream (`relayed`, the choices of the
    `Text`s the test read), then each choice's end."""

    def __init__(self, ids: list[int], model_dir: Path) -> None:
        super().__init__(ids, [], 0.0, 1, (str(model_dir), MODEL))
        self.relayed: list[int] = []

    async def Generate(
        self, request: pb.GenerateRequest, context: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = len(request.tokenized.input_ids)
        assert request.sampling_params.n == 3
        sent = [0, 0, 0]
        for count, index in enumerate(ORDER):
            token = self.ids[sent[index]]
            sent[index] += 1
            chunk = pb.GenerateStreamChunk(
                token_ids=[token], index=index, prompt_tokens=prompt, completion_tokens=sent[index]
            )
            yield pb.GenerateResponse(chunk=chunk)
            await until(partial(self._relayed, count + 1), f"message {count + 1} relayed")
        for index in ENDS:
            done = pb.GenerateComplete(
                output_ids=[self.ids[sent[index] - 1]],  # the last chunk's, as vLLM's
                index=index,
                finish_reason="length",
                prompt_tokens=prompt,
                completion_tokens=sent[index],
            )
            yield pb.GenerateResponse(complete=done)

    def _relayed(self, messages: int) -> bool:
        return len(self.relayed) >= messages


@pytest.mark.parametrize(
    "target",
    ["127.0.0.1:%d", "dns:///127.0.0.1:%d"],
    ids=["own-http2-client", "grpc-aio"],
)
def test_n_choices_are_relayed_as_the_engine_interleaves_them_each_with_its_own_end(
    server_loop: ServerLoop, model_dir: Path, target: str
) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # words whose every token has text of its own: a Text a message
    ids = tokenizer.encode(" one two three", add_special_tokens=False).ids[:3]
    assert len(ids) == 3 and all(tokenizer.decode([i]).strip() for i in ids)
    engine = Lockstep(ids, model_dir)

    async def events() -> list[Event]:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        upstream = VllmGrpcUpstream(target % port, model=MODEL, tokenizer=str(model_dir))
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        request = GenerateRequest(
            MODEL, messages=(Message("user", "hello"),), n=3, sampling=sampling
        )
        out: list[Event] = []
        try:
            async for event in upstream.call(request, HANG_GUARD):
                out.append(event)
                if isinstance(event, Text):
                    engine.relayed.append(event.index)
        finally:
            await upstream.close()
            await server.stop(None)
        return out

    out = server_loop.call(events())
    assert isinstance(out[0], Started) and out[0].prompt_tokens > 0
    assert engine.relayed == ORDER  # as the engine sent them, each before the next was sent
    finished = [e for e in out if isinstance(e, Finished)]
    assert [e.index for e in finished] == ENDS
    assert all(e.reason is FinishReason.LENGTH and e.completion_tokens == 3 for e in finished)
    assert all(isinstance(e, Finished) for e in out[-3:])  # after every choice's text
