"""A fast stand-in of vLLM's gRPC server (`vllm.grpc.engine.VllmEngine`), for measuring
and profiling the gateway's own work on the `upstream: vllm-grpc` path without an engine
eating the cores: `Generate` streams one chunk per token (as vLLM does, one per engine
step; `--tokens-per-chunk` N after the first, as vLLM's `--stream-interval N`) every
`--step-ms` milliseconds a token, the tokens of a fixed English text encoded with the
model's own tokenizer (so the gateway's detokenizer and stop matching see real text),
until `max_tokens`; then a `complete` with finish reason `length`. `GetModelInfo`,
`HealthCheck`, `GetLoads`, `Abort` and `grpc.health.v1` answer as vLLM's do. The streams
share the steps, as a batch does: their tokens of a step go out together.

Not an engine: the prompt's ids are only counted, and remembered as a prefix cache of
whole prompts would: a prompt sent before has its whole blocks of `BLOCK` tokens cached
(`cached_tokens` on each message, as vLLM's say `num_cached_tokens`). Used by
`benchmarks/profile_gateway.py`.

Run: `python -m benchmarks.fake_vllm_grpc --port N --model-dir DIR [--step-ms MS]
[--tokens-per-chunk N] [--served-model-name NAME]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc
from tokenizers import Tokenizer

from benchmarks.fake_openai import Steps

TEXT = (
    "The gateway renders the chat template, tokenizes the prompt and streams the answer "
    "back as it comes, one token at a time, never splitting a character: café, naïve. "
)
CONTEXT = 1024
#: Tokens a block of the stand-in's prefix cache holds (vLLM's default block size).
BLOCK = 16
#: Prompts it remembers before it forgets them all.
REMEMBERED = 10_000


class FakeVllm(pb_grpc.VllmEngineServicer):
    """Answers every request with the text's ids, one chunk per step."""

    def __init__(
        self, ids: list[int], eos: list[int], step: float, per_chunk: int, model: tuple[str, str]
    ) -> None:
        self.ids, self.eos, self.step, self.per_chunk = ids, eos, step, per_chunk
        self.model_dir, self.name = model
        self.steps = Steps(step)
        self.seen: set[bytes] = set()  # the prompts sent before, as their ids' bytes

    def _cached(self, ids: list[int]) -> int:
        """The prompt's cached tokens: its whole blocks, where it was sent before."""
        key = b"".join(i.to_bytes(4, "little") for i in ids)
        if key in self.seen:
            return len(ids) // BLOCK * BLOCK
        if len(self.seen) >= REMEMBERED:
            self.seen.clear()
        self.seen.add(key)
        return 0

    async def Generate(
        self, request: pb.GenerateRequest, context: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        prompt = len(request.tokenized.input_ids)
        cached = self._cached(list(request.tokenized.input_ids))
        wanted = request.sampling_params.max_tokens or 16
        ids = list(itertools.islice(itertools.cycle(self.ids), wanted))
        sent = 0
        while sent < wanted:
            # the first token alone, then `per_chunk` a chunk (vLLM's --stream-interval)
            tokens = ids[sent : sent + (self.per_chunk if sent else 1)]
            sent += len(tokens)
            if self.step:
                for _ in tokens:
                    await self.steps.next()
            chunk = pb.GenerateStreamChunk(
                token_ids=tokens, prompt_tokens=prompt, completion_tokens=sent, cached_tokens=cached
            )
            yield pb.GenerateResponse(chunk=chunk)
        # the end repeats the last chunk's tokens, as vLLM's does (a streaming client
        # adds up the chunks)
        done = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason="length",
            prompt_tokens=prompt,
            completion_tokens=sent,
            cached_tokens=cached,
        )
        yield pb.GenerateResponse(complete=done)

    async def GetModelInfo(self, request: object, context: object) -> pb.GetModelInfoResponse:
        return pb.GetModelInfoResponse(
            model_path=self.model_dir,
            tokenizer_path=self.model_dir,
            served_model_name=self.name,
            is_generation=True,
            max_context_length=CONTEXT,
            eos_token_ids=self.eos,
        )

    async def HealthCheck(self, request: object, context: object) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(healthy=True, message="ok")

    async def GetLoads(self, request: object, context: object) -> pb.GetLoadsResponse:
        return pb.GetLoadsResponse()

    async def Abort(self, request: object, context: object) -> pb.AbortResponse:
        return pb.AbortResponse()


async def serve(port: int, model_dir: Path, step: float, per_chunk: int, name: str) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_ids = [i for i in [tokenizer.token_to_id(eos)] if i is not None] if eos else []
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    engine = FakeVllm(ids, eos_ids, step, per_chunk, (str(model_dir), name))
    server, _ = await start(engine, port)
    await server.wait_for_termination()


async def start(engine: pb_grpc.VllmEngineServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """`engine` served on loopback at `port` (0: a free one), its grpc.health.v1 service
    SERVING, as vLLM's gRPC server has it; the server, started, and its port."""
    server = grpc.aio.server()
    pb_grpc.add_VllmEngineServicer_to_server(engine, server)
    checks = health.aio.HealthServicer()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--step-ms", type=float, default=2.0, help="milliseconds per token")
    parser.add_argument(
        "--tokens-per-chunk", type=int, default=1, help="tokens a chunk after the first"
    )
    parser.add_argument(
        "--served-model-name", default="fake", help="the model's name in GetModelInfo"
    )
    args = parser.parse_args()
    step = args.step_ms / 1e3
    name = args.served_model_name
    uvloop.run(serve(args.port, args.model_dir, step, args.tokens_per_chunk, name))


if __name__ == "__main__":
    main()
