"""A by-hand check of the transformers worker on a GPU machine: pytest does not
collect it (CI machines have no GPU). It loads a model (a local folder, or the
tests' tiny random Llama built on the spot), checks that greedy decoding on the
device matches transformers' own `generate`, then measures tokens per second,
first the engine alone and then through a real worker and gateway on loopback.

    python -m benchmarks.gpu_smoke --device cuda [--model-path DIR] [--dtype bfloat16]
        [--tokens 256] [--streams 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import openai
import torch

from gateway.config import Config, ModelConfig
from gateway.lifecycle import GatewayServer
from gateway.protocol.types import Finished, GenerateRequest, SamplingParams, Started
from gateway.worker.server import WorkerServer
from gateway.worker.transformers_engine import TransformersEngine
from tests.support.tiny_model import build_tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def _request(engine: TransformersEngine, tokens: int, seed: int | None = None) -> GenerateRequest:
    sampling = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=tokens)
    return GenerateRequest(engine.model, prompt=PROMPT, sampling=sampling)


async def _one(engine: TransformersEngine, tokens: int, seed: int | None) -> tuple[float, int]:
    """Seconds to the first text, and the tokens generated."""
    start = time.perf_counter()
    first = 0.0
    async for event in engine.generate(_request(engine, tokens, seed)):
        if not first and not isinstance(event, Started):
            first = time.perf_counter() - start
        if isinstance(event, Finished):
            return first, event.completion_tokens
    raise AssertionError("no Finished event")


async def engine_rates(engine: TransformersEngine, tokens: int, streams: int) -> None:
    """Tokens per second of the engine alone, one stream and `streams` at once."""
    await _one(engine, 8, None)  # warm-up: kernels, allocator
    for count in (1, streams):
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(engine, tokens, i) for i in range(count)))
        seconds = time.perf_counter() - start
        total = sum(n for _, n in results)
        ttft = sum(t for t, _ in results) / count
        print(
            f"engine  {count:3d} stream(s): {total / seconds:9.1f} tokens/s in all, "
            f"{total / seconds / count:8.1f} per stream, mean first text {ttft * 1000:.1f} ms"
        )


async def gateway_rates(engine: TransformersEngine, tokens: int, streams: int) -> None:
    """The same through a worker and the gateway, streamed with the openai SDK."""
    worker = WorkerServer(engine)
    await worker.start()
    model = ModelConfig(engine.model, workers=(worker.address,))
    server = GatewayServer(Config(host="127.0.0.1", port=0, log_level="warning", models=(model,)))
    await server.start()
    port = server.port
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

    async def stream(seed: int) -> int:
        chunks = await client.completions.create(
            model=engine.model,
            prompt=PROMPT,
            max_tokens=tokens,
            temperature=0.8,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        used = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return used

    try:
        for count in (1, streams):
            start = time.perf_counter()
            total = sum(await asyncio.gather(*(stream(i) for i in range(count))))
            seconds = time.perf_counter() - start
            print(f"gateway {count:3d} stream(s): {total / seconds:9.1f} tokens/s in all")
    finally:
        await client.close()
        await server.stop()
        await worker.stop(grace=1.0)


def check_greedy(engine: TransformersEngine) -> None:
    """The engine's greedy answer on the device equals transformers' `generate`."""

    async def ours() -> str:
        pieces = []
        async for event in engine.generate(_request(engine, 16)):
            if not isinstance(event, Started | Finished):
                pieces.append(event.text)
        return "".join(pieces)

    ids = engine.tokenizer(PROMPT, return_tensors="pt").input_ids.to(engine.device)
    out = engine.hf_model.generate(ids, do_sample=False, max_new_tokens=16)
    reference = engine.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    got = asyncio.run(ours())
    print(f"greedy matches transformers.generate: {got == reference}")
    if got != reference:  # half precision may legitimately break a near-tie
        print(f"  ours:      {got!r}\n  reference: {reference!r}")


def main() -> None:
    """Builds or loads the model, then prints the checks and rates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a local model folder (default: a tiny random Llama)")
    parser.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per answer")
    parser.add_argument("--streams", type=int, default=8, help="answers at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model_path) if args.model_path else build_tiny_model(Path(tmp) / "tiny")
        engine = TransformersEngine(path, device=args.device, dtype=args.dtype)
        print(
            f"model {engine.model} on {engine.device} ({engine.hf_model.dtype}), "
            f"context {engine.max_context}, torch {torch.__version__}, "
            f"cuda {torch.cuda.is_available()}"
        )
        check_greedy(engine)
        asyncio.run(engine_rates(engine, args.tokens, args.streams))
        asyncio.run(gateway_rates(engine, args.tokens, args.streams))
        engine.close()


if __name__ == "__main__":
    main()
