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

The count is also cut at the loop's wakes: each callback the loop runs (a protocol's
`data_received`, a task's step, a timer) is an activation, and a request's first token
waits for some of them only. With the engine pacing its tokens (`--step-ms`, as a real
engine's steps do), those are the edge's read of the request and its task up to the
call's write to the engine (`protocol/http1.py`'s `send`, `protocol/grpc_h2.py`'s
`start`: an activation is cut there), then the read that brings the first text, which
the edge writes in the same callback; the rest runs while the engine works or after the
answer. The report gives that sum, "on the first token's way", and its costliest
functions, the median read of a later text (each paced token's), and the activations of
the last request, in order. Methods made by exec (a dataclass's `__init__`, `<string>`)
are named by their class.

Run: `.venv/bin/python -m benchmarks.bytecodes [--path http|grpc] [--requests N]
[--max-tokens N] [--step-ms MS] [--top K] [--baseline REV]` (under a minute). With
`--baseline` the same count for the gateway as committed at REV, beside it. Not collected
by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import statistics
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


#: Where an activation is cut: the call's write to the engine (file, function).
CALL_WRITES = {("protocol/http1.py", "send"), ("protocol/grpc_h2.py", "start")}


def _key(code: CodeType, owners: dict[CodeType, str]) -> str:
    """A code's file, line and name; for a method made by exec (a dataclass's
    `__init__`), its class's name before its own."""
    name = code.co_name
    if code in owners:
        name = f"{owners[code]}.{name}"
    return f"{code.co_filename}:{code.co_firstlineno}:{name}"


def _is_call_write(code: CodeType) -> bool:
    return any(
        code.co_name == name and code.co_filename.endswith(file) for file, name in CALL_WRITES
    )


def _names(key: str, file: str, name: str) -> bool:
    """Whether a code's key (`_key`) is `name` in a file whose path ends with `file`."""
    filename, _, function = key.rsplit(":", 2)
    return function == name and filename.endswith(file)


def serve(argv: list[str]) -> None:
    """`gateway serve`, its loop's thread counted between SIGUSR1 and SIGUSR2: by code
    object, and by activation (`wakes`: the code the loop called, or the call's write,
    and its counts by code object)."""
    counts: collections.Counter[CodeType] = collections.Counter()
    wakes: list[tuple[CodeType | None, collections.Counter[CodeType]]] = []
    wake: collections.Counter[CodeType] = collections.Counter()
    outer: set[CodeType] = set()  # the frames under the loop's run, when it started
    writes: dict[CodeType, bool] = {}
    owners: dict[CodeType, str] = {}  # made by exec: the class of their `self`

    def opcode(frame: FrameType, event: str, _: object) -> Any:
        if event == "opcode":
            counts[frame.f_code] += 1
            wake[frame.f_code] += 1
        return opcode

    def call(frame: FrameType, _event: str, _arg: object) -> Any:
        nonlocal wake
        frame.f_trace_opcodes = True
        code, back = frame.f_code, frame.f_back
        write = writes.get(code)
        if write is None:
            write = writes[code] = _is_call_write(code)
            if code.co_filename == "<string>" and "self" in frame.f_locals:
                owners[code] = type(frame.f_locals["self"]).__qualname__
        if write or back is None or back.f_code in outer:
            wake = collections.Counter()
            wakes.append((code, wake))
        return opcode

    def start(*_: object) -> None:
        # from a callback of the loop: a request's task may still be ending now
        asyncio.get_running_loop().call_soon_threadsafe(begin)

    def begin() -> None:
        nonlocal wake
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:  # the frames the loop runs its callbacks from
            outer.add(frame.f_code)
            frame = frame.f_back
        counts.clear()
        wake = collections.Counter()
        wakes[:] = [(None, wake)]
        sys.settrace(call)

    def stop(*_: object) -> None:
        sys.settrace(None)
        out: collections.Counter[str] = collections.Counter()
        for each, n in counts.items():
            out[_key(each, owners)] += n
        activations = []
        for called, functions in wakes:
            named: collections.Counter[str] = collections.Counter()
            for each, n in functions.items():
                named[_key(each, owners)] += n
            activations.append([None if called is None else _key(called, owners), dict(named)])
        Path(os.environ[COUNTS_ENV]).write_text(
            json.dumps({"functions": out, "wakes": activations})
        )

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


Activation = tuple[str | None, dict[str, int]]  # the code the loop called; counts by code

#: The edge's parser callback that begins a request, and the encoder's step for a text.
_REQUEST_BEGINS = ("edge/http_protocol.py", "on_message_begin")
_TEXT_ENCODED = ("edge/openai/encoding.py", "delta")


def _runs(activation: Activation, file: str, name: str) -> bool:
    return any(_names(key, file, name) for key in activation[1])


def _requests(wakes: list[Activation]) -> list[list[Activation]]:
    """The activations split where a request begins (the first, partial, dropped)."""
    requests: list[list[Activation]] = []
    for activation in wakes:
        if _runs(activation, *_REQUEST_BEGINS):
            requests.append([])
        if requests:
            requests[-1].append(activation)
    return requests[:-1]  # the last may be cut by the stop


def way_activations(request: list[Activation]) -> tuple[list[Activation], Activation] | None:
    """A request's activations up to the call's write, and the one that encodes its
    first text after it; None where either is missing."""
    writes = [
        i
        for i, (code, _) in enumerate(request)
        if code and any(_names(code, file, name) for file, name in CALL_WRITES)
    ]
    if not writes:
        return None
    for activation in request[writes[0] :]:
        if _runs(activation, *_TEXT_ENCODED):
            return request[: writes[0]], activation
    return None


def first_token_way(request: list[Activation]) -> tuple[int, int] | None:
    """The bytecodes of a request's activations up to the call's write, and of the one
    that encodes its first text after it; None where either is missing."""
    way = way_activations(request)
    if way is None:
        return None
    before, first = way
    return sum(sum(counts.values()) for _, counts in before), sum(first[1].values())


def way_functions(requests: list[list[Activation]]) -> collections.Counter[str]:
    """The bytecodes on the first token's way by function, summed over `requests`."""
    summed: collections.Counter[str] = collections.Counter()
    for request in requests:
        way = way_activations(request)
        if way is not None:
            for _, counts in [*way[0], way[1]]:
                summed.update(counts)
    return summed


def later_texts(request: list[Activation]) -> list[int]:
    """The bytecodes of each activation that encodes a text after the first one's, but
    the last (which mostly brings the answer's end too): a paced token's read."""
    texts = [
        sum(counts.values()) for code, counts in request if _runs((code, counts), *_TEXT_ENCODED)
    ]
    return texts[1:-1]


def wakes_report(wakes: list[Activation], source: Path, top: int) -> str:
    """On the first token's way, a request (the means) and its `top` functions, a later
    token's read (the median), and the last request's activations in order, each with its
    three costliest functions."""
    requests = _requests(wakes)
    ways = [way for way in map(first_token_way, requests) if way is not None]
    if not ways:
        return "no request with a call's write and a text found"
    before = sum(b for b, _ in ways) / len(ways)
    first = sum(f for _, f in ways) / len(ways)
    lines = [
        f"On the first token's way: {before + first:,.0f} bytecodes a request "
        f"({before:,.0f} up to the call's write, {first:,.0f} in the read that brings "
        f"the first text), over {len(ways)} requests",
    ]
    later = [n for request in requests for n in later_texts(request)]
    if later:
        lines.append(
            f"A later text's read: {statistics.median(later):,.0f} bytecodes (the median "
            f"of {len(later)}; with --step-ms, a paced token's)"
        )
    lines += ["", "| on the first token's way: function | a request |", "| --- | ---: |"]
    for key, n in way_functions(requests).most_common(top):
        lines.append(f"| {_short(key, source)} | {n / len(ways):,.1f} |")
    lines += [
        "",
        "| the last request's activations | bytecodes | its costliest functions |",
        "| --- | ---: | --- |",
    ]
    for code, counts in requests[-1]:
        costliest = sorted(counts.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{_short(k, source).rsplit(':', 1)[1]} {n}" for k, n in costliest)
        lines.append(f"| {_short(code or '-', source)} | {sum(counts.values()):,} | {named} |")
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
    counted = json.loads(out.read_text())
    counts: dict[str, int] = counted["functions"]
    wakes: list[Activation] = [(code, functions) for code, functions in counted["wakes"]]
    print(report(counts, args.requests, args.top, source))
    print()
    print(wakes_report(wakes, source, args.top))
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
    parser.add_argument("--step-ms", type=float, default=0.0, help="the engine's ms a token")
    parser.add_argument("--top", type=int, default=40, help="files and functions listed")
    parser.add_argument("--baseline", metavar="REV", help="also the gateway as at REV")
    args = parser.parse_args()
    answer_length(args.path, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="bytecodes-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = build_vllm_model(work / "model")
        model = start_engine(stack, args.path, model_dir, False, step_ms=args.step_ms)
        totals = {"working tree": count(ROOT, model, work, args)}
        if args.baseline:
            print(f"\n--- {args.baseline}")
            source = export(args.baseline, work / "baseline")
            totals[args.baseline] = count(source, model, work, args)
        print(
            f"\n{args.path} path, {args.max_tokens} tokens an answer, a token every "
            f"{args.step_ms:g} ms, one request at a time"
        )
        for name, total in totals.items():
            print(f"{name}: {total:,} bytecodes a request")


if __name__ == "__main__":
    main()
