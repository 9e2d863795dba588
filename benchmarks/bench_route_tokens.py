"""Benchmark: the gateway's CPU to turn a chat into the token ids kv_aware routing hashes
(issue 26), without engines: `ModelTokenizer.prompt_ids` (the whole rendered prompt
encoded, as the router did) against `routing_ids` (piece by piece, recent pieces reused),
both called as the router calls them (`asyncio.to_thread`), and `routing_ids` called on
the event loop itself (what the thread hop costs), interleaved, each on a tokenizer of
its own, on
`bench_routing`'s workload and tokenizer: its documents as system prompts,
conversations growing by a user turn of ~`--turn-tokens` and a fixed answer.

Each round has its own documents (a salt), so a round starts with nothing kept; every
call's ids are checked to be the same both ways. Prints per call: the process's CPU and
the wall time, mean and p50, with the prompts' mean length in tokens.

`--serial` sets `TOKENIZERS_PARALLELISM=false`: tokenizers' batch call then encodes on
the calling thread instead of handing each text to its rayon pool, whose threads spin
a while for more work after each (CPU the process pays, seen here as ~0.2 ms a call).

Run: `.venv/bin/python -m benchmarks.bench_route_tokens [--rounds 10] [--turns 4]
[--serial]` (under a minute here). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.bench_routing import ANSWER, _documents, user_turn, workload_arguments
from gateway.protocol.types import Message
from gateway.tokenization.tokenizer import ModelTokenizer
from tests.support.tiny_model import build_tokenizer

Encode = Callable[[str | None, list[Message] | None], list[int]]


@dataclass
class Way:
    """One way of encoding, on a tokenizer of its own (so no way warms another's caches),
    and its (CPU, wall) seconds per call."""

    name: str
    encode: Encode
    threaded: bool = True
    times: list[tuple[float, float]] = field(default_factory=list)

    async def __call__(self, messages: list[Message]) -> list[int]:
        cpu, wall = time.process_time(), time.perf_counter()
        if self.threaded:
            ids = await asyncio.to_thread(self.encode, None, messages)
        else:
            ids = self.encode(None, messages)
        self.times.append((time.process_time() - cpu, time.perf_counter() - wall))
        return ids


async def _run(directory: Path, args: argparse.Namespace) -> None:
    tokenizer = ModelTokenizer(directory)
    ways = [
        Way("prompt_ids", tokenizer.prompt_ids),
        Way("routing_ids", ModelTokenizer(directory).routing_ids),
        Way("routing_ids, on the loop", ModelTokenizer(directory).routing_ids, threaded=False),
    ]
    lengths: list[int] = []
    rng = random.Random(7)
    for round_ in range(args.rounds):
        docs = _documents(tokenizer, f"round {round_}", args.documents, args.doc_tokens)
        talks = [[Message("system", docs[c % len(docs)])] for c in range(args.conversations)]
        for turn in range(args.turns):
            for talk in talks:
                talk.append(Message("user", user_turn(rng, turn, args.turn_tokens)))
                expected = await ways[0](talk)
                for way in ways[1:]:
                    assert await way(talk) == expected, f"{way.name} differs from prompt_ids"
                lengths.append(len(expected))
                talk.append(Message("assistant", ANSWER))
    print(
        f"{len(lengths)} calls each, prompts of {statistics.mean(lengths):,.0f} tokens on "
        f"average ({args.documents} documents of ~{args.doc_tokens} tokens, "
        f"{args.conversations} conversations x {args.turns} turns, {args.rounds} rounds"
        f"{', serial' if args.serial else ''}; load average {os.getloadavg()[0]:.1f})"
    )
    print("| call | CPU mean | CPU p50 | wall mean | wall p50 |\n| --- | --- | --- | --- | --- |")
    for way in ways:
        cpu = [c * 1e3 for c, _ in way.times]
        wall = [w * 1e3 for _, w in way.times]
        print(
            f"| {way.name} | {statistics.mean(cpu):.3f} ms | {statistics.median(cpu):.3f} ms | "
            f"{statistics.mean(wall):.3f} ms | {statistics.median(wall):.3f} ms |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    workload_arguments(parser)
    parser.add_argument("--serial", action="store_true", help="TOKENIZERS_PARALLELISM=false")
    args = parser.parse_args()
    if args.serial:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with tempfile.TemporaryDirectory() as raw:
        build_tokenizer().save_pretrained(raw)
        asyncio.run(_run(Path(raw), args))


if __name__ == "__main__":
    main()
