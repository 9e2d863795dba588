"""How much Python the gateway runs a request: the bytecodes it executes, counted, by module
and by function. On the paths of `profile_gateway` (`upstream: openai` in front of
`benchmarks/fake_openai.py`, `upstream: vllm-grpc` in front of `benchmarks/fake_vllm_grpc.py`),
streamed chats one at a time.

perf over the gateway's process (`perf record -p PID`, then `perf report --sort dso`) puts
two thirds of its CPU a request in the interpreter (`_PyEval_EvalFrameDefault` and its
helpers), a fifth in the kernel and 3 % in uvloop: the cost is the Python that runs, spread
over hundreds of functions. A sampling profiler's shares of that move from run to run and
cProfile's overhead is per call, so it inflates small functions; a count of bytecodes is
exact and the same in every run, so a change that makes the gateway run less Python shows
as a smaller number whatever the machine's load. (A bytecode is not a fixed cost: calls
and allocations weigh more than a local's load. CPU a request is `profile_gateway`'s.)

The gateway runs as `python benchmarks/bytecodes.py serve --config FILE` (`gateway serve`
with a tracer that sets `f_trace_opcodes` on every frame of the loop's thread between
SIGUSR1 and SIGUSR2); the counts of the measured requests go to a JSON file, per code
object. Warm-up requests run before the count starts (first-call caches, the connection
to the engine).

Run: `.venv/bin/python -m benchmarks.bytecodes [--path http|grpc] [--requests N]
[--max-tokens N] [--top K] [--baseline REV]` (under a minute). With `--baseline` the same
count for the gateway as committed at REV, beside it. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
if sys.argv[1:2] != ["serve"]:  # the gateway counted is the one on its PYTHONPATH
    sys.path.insert(0, str(ROOT))

#: Where the gateway writes its counts (`serve`).
COUNTS_ENV = "BYTECODE_COUNTS"


def serve(argv: list[str]) -> None:
    """`gateway serve`, its loop's thread counted between SIGUSR1 and SIGUSR2."""
    counts: collections.Counter[CodeType] = collections.Counter()

    def opcode(frame: FrameType, event: str, _: object) -> Any:
        if event == "opcode":
            counts[frame.f_code] += 1
        return opcode

    def call(frame: FrameType, _event: str, _arg: object) -> Any:
        frame.f_trace_opcodes = True
        return opcode

    def start(*_: object) -> None:
        counts.clear()
        sys.settrace(call)

    def stop(*_: object) -> None:
        sys.settrace(None)
        out: collections.Counter[str] = collections.Counter()
        for code, n in counts.items():  # summed: dataclasses' `__init__`s share a name
            out[f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"] += n
        Path(os.environ[COUNTS_ENV]).write_text(json.dumps(out))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from gateway.cli import main

    main(["serve", *argv])


def _short(filename: str, source: Path) -> str:
    """A file's name from the gateway's root or site-packages (the rest as it is)."""
    for root in (f"{source}/", "site-packages/"):
        if root in filename:
            return filename.split(root, 1)[1]
    return filename


def report(counts: dict[str, int], requests: int, top: int, source: Path) -> str:
    """The counts a request: the total, by file, and the `top` functions."""
    by_file: collections.Counter[str] = collections.Counter()
    for key, n in counts.items():
        by_file[_short(key.rsplit(":", 2)[0], source)] += n
    total = sum(counts.values())
    lines = [f"{total / requests:,.0f} bytecodes a request", "", "| file | a request |"]
    lines += ["| --- | ---: |"]
    lines += [f"| {f} | {n / requests:,.0f} |" for f, n in by_file.most_common(top)]
    lines += ["", "| function | a request |", "| --- | ---: |"]
    for key, n in sorted(counts.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| {_short(key, source)} | {n / requests:,.1f} |")
    return "\n".join(lines)


def count(source: Path, model: dict[str, object], work: Path, args: argparse.Namespace) -> int:
    """Starts the gateway in `source` in front of `model`, counts `args.requests` chats,
    prints the report; the total a request."""
    from benchmarks.bench_gateway import _gateway_ready, _stop
    from benchmarks.bench_vllm import HttpCalls, run_load
    from benchmarks.profile_gateway import EXTRA
    from tests.support.processes import free_port

    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning", "models": [model]}
    (work / "gateway.yaml").write_text(yaml.safe_dump(config))
    out = work / f"counts-{port}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "serve"]
    environment = {**os.environ, COUNTS_ENV: str(out), "PYTHONPATH": str(source)}
    gateway = subprocess.Popen(
        [*command, "--config", str(work / "gateway.yaml")], cwd=source, env=environment
    )
    try:
        while not _gateway_ready(port):
            if gateway.poll() is not None:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"

        def load(requests: int) -> None:
            asyncio.run(run_load(lambda: HttpCalls(url, EXTRA), 1, requests))

        load(50)  # warm
        gateway.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        load(args.requests)
        time.sleep(0.3)
        gateway.send_signal(signal.SIGUSR2)
        end = time.monotonic() + 30
        while not out.exists() and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        _stop(gateway)
    counts: dict[str, int] = json.loads(out.read_text())
    print(report(counts, args.requests, args.top, source))
    return round(sum(counts.values()) / args.requests)


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
        return
    from benchmarks.profile_gateway import answer_length, export, start_engine
    from tests.support.vllm import build_vllm_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("grpc", "http"), default="http")
    parser.add_argument("--requests", type=int, default=200, help="requests counted")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens an answer")
    parser.add_argument("--top", type=int, default=40, help="files and functions listed")
    parser.add_argument("--baseline", metavar="REV", help="also the gateway as at REV")
    args = parser.parse_args()
    answer_length(args.path, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="bytecodes-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = build_vllm_model(work / "model")
        model = start_engine(stack, args.path, model_dir, False, step_ms=0.0)
        totals = {"working tree": count(ROOT, model, work, args)}
        if args.baseline:
            print(f"\n--- {args.baseline}")
            source = export(args.baseline, work / "baseline")
            totals[args.baseline] = count(source, model, work, args)
        print(f"\n{args.path} path, {args.max_tokens} tokens an answer, one request at a time")
        for name, total in totals.items():
            print(f"{name}: {total:,} bytecodes a request")


if __name__ == "__main__":
    main()
