"""What waking a task costs a paced event: a uvloop process that relays small messages
from one process to another, a message every 10 ms, either writing each in the
transport's callback that read it (`callback`), or waking a task that waits on a future
through a chain of `--depth` coroutines, which then writes it (`task`), as a request's
task did for each token before the edge's sink. Prints the process's CPU an event for
each, interleaved over rounds: the baseline (the callback) is measured in the same run.

    .venv/bin/python -m benchmarks.bench_wake --events 600 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable

import uvloop

STEP = 0.01  # the producer's pace: an engine's step


def _produce(out: socket.socket, events: int) -> None:
    """A child: one 120-byte message every STEP seconds, then the end."""
    for _ in range(events):
        out.send(b"x" * 120)
        time.sleep(STEP)
    out.close()


def _drain(into: socket.socket) -> None:
    """A child: reads what the relay writes until it closes."""
    while into.recv(65536):
        pass


class _Relay(asyncio.Protocol):
    """Reads the producer's messages; writes each at once (`direct`), or hands it to a
    waiting task through a future."""

    def __init__(self, out: asyncio.Transport, direct: bool) -> None:
        self.out, self.direct = out, direct
        self.ready: list[bytes] = []
        self.waiter: asyncio.Future[None] | None = None
        self.done = asyncio.get_running_loop().create_future()
        self.events = 0

    def data_received(self, data: bytes) -> None:
        self.events += 1
        if self.direct:
            self.out.write(b"data: " + data + b"\n\n")
            return
        self.ready.append(data)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _write_loop(relay: _Relay, depth: int) -> None:
    """The task: `depth` frames down, waits for each message and writes it."""
    if depth:
        return await _write_loop(relay, depth - 1)
    loop = asyncio.get_running_loop()
    while not relay.done.done():
        relay.waiter = loop.create_future()
        await relay.waiter
        ready, relay.ready = relay.ready, []
        if ready:
            relay.out.write(b"data: " + b"".join(ready) + b"\n\n")


def _fork(work: Callable[[], None], keep: socket.socket, close: list[socket.socket]) -> int:
    """A child process running `work` with only `keep` of the sockets open."""
    pid = os.fork()
    if pid == 0:
        for other in close:
            if other is not keep:
                other.close()
        work()
        os._exit(0)
    return pid


async def _relay_once(direct: bool, depth: int, events: int) -> float:
    """One relay of `events` paced messages: the CPU seconds an event."""
    into_relay, producer_end = socket.socketpair()
    out_of_relay, drain_end = socket.socketpair()
    every = [into_relay, producer_end, out_of_relay, drain_end]
    children = [
        _fork(lambda: _produce(producer_end, events), producer_end, every),
        _fork(lambda: _drain(drain_end), drain_end, every),
    ]
    producer_end.close()
    drain_end.close()
    loop = asyncio.get_running_loop()
    out, _ = await loop.connect_accepted_socket(asyncio.Protocol, out_of_relay)
    relay = _Relay(out, direct)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await loop.connect_accepted_socket(lambda: relay, into_relay)
    if direct:
        await relay.done
    else:
        await _write_loop(relay, depth)
    after = resource.getrusage(resource.RUSAGE_SELF)
    out.close()
    for pid in children:
        await asyncio.to_thread(os.waitpid, pid, 0)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu / max(1, relay.events)


async def main(args: argparse.Namespace) -> None:
    deep = f"task, {args.depth} deep"
    kinds = {"callback": (True, 0), "task": (False, 0), deep: (False, args.depth)}
    samples: dict[str, list[float]] = {name: [] for name in kinds}
    for round_ in range(args.rounds):
        for name, (direct, depth) in kinds.items():
            samples[name].append(await _relay_once(direct, depth, args.events))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(samples["callback"])
    print("| relay | CPU an event | ÷ callback |")
    print("| --- | --- | --- |")
    for name, values in samples.items():
        median = statistics.median(values)
        low, high = min(values) * 1e6, max(values) * 1e6
        print(f"| {name} | {median * 1e6:.0f} ({low:.0f} to {high:.0f}) µs | {median / base:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=600, help="messages a relay")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--depth", type=int, default=12, help="coroutines the task waits under")
    uvloop.run(main(parser.parse_args()))
