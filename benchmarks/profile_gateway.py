"""The gateway's own CPU on the real-engine paths, measured and profiled against fast
stand-ins of the engines, so the engine takes no core from it and the figure moves little:

- `grpc`: `upstream: vllm-grpc` (the gateway renders the template, tokenizes,
  detokenizes, matches stops, parses tools) in front of `benchmarks/fake_vllm_grpc.py`,
  one chunk a token as vLLM sends them;
- `http`: `upstream: openai` in front of `benchmarks/fake_openai.py`.

Both stand-ins send a token each `--step-ms` (2 ms, a vLLM step on a GPU), the streams
sharing each step as a batch does: unpaced, one read would carry many tokens and hide the
gateway's cost a read (the HTTP path read 41 µs a token so, against 290 µs paced, as
in front of vLLM).

Streamed chat completions (`--max-tokens`, 64 by default; usage chunk on), 1 stream and 8 at once,
`--requests` each; the median time to first token the client saw, the gateway's process CPU
(/proc) per request and per token, and of it the event loop's thread (the rest is gRPC's own
threads). With `--raw` (grpc) a row for the raw grpc.aio client of `bench_vllm` in this
process against the same stand-in: the floor a Python client pays per message (its answers
are 64 tokens whatever `--max-tokens` says). With
`--tools` the requests carry a tool (`tool_choice: auto`, the model's `hermes` format),
so the tool-call parser scans the text. With `--py-spy DIR` each load also runs once
under `py-spy record` (sampling the gateway from outside; its figures then are not the
measured ones) and the top functions by own and by inclusive time are printed, from
py-spy's collapsed stacks (kept in DIR, with a speedscope file to browse).

Run: `python -m benchmarks.profile_gateway [--path grpc|http] [--requests N] [--rounds R]
[--max-tokens N] [--tools] [--baseline REV|DIR] [--env NAME=VALUE] [--raw] [--py-spy DIR]`
(py-spy: `pip install py-spy`, not a dependency of the project). `--env` sets a variable
in the working tree's gateway only: with `--baseline` naming the same tree (a directory),
the table is that setting's effect (e.g. `GRPC_EXPERIMENTS`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import cast

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop, process_cpu  # noqa: E402
from benchmarks.bench_vllm import (  # noqa: E402
    MODEL,
    GrpcCalls,
    HttpCalls,
    Sample,
    run_load,
    spread,
)
from gateway.tokenization import load_tokenizer  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.tiny_model import tools_tokenizer  # noqa: E402
from tests.support.vllm import build_vllm_model  # noqa: E402

LOADS = (1, 8)
#: Milliseconds between two tokens of the stand-in vLLM (`--step-ms`).
STEP_MS = 2.0
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _wait(check: object, process: subprocess.Popen[bytes], what: str) -> None:
    end = time.monotonic() + 60
    while not check():  # type: ignore[operator]
        if time.monotonic() > end or process.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.1)


def start_engine(
    stack: ExitStack,
    path: str,
    model_dir: Path,
    tools: bool,
    step_ms: float = STEP_MS,
    per_chunk: int = 1,
) -> dict[str, object]:
    """The stand-in engine; the gateway's model entry in front of it (with a chat template
    that shows the model its tools, for `tools`)."""
    port = free_port()
    if path == "grpc":
        command = ["-m", "benchmarks.fake_vllm_grpc", "--port", str(port)]
        command += ["--model-dir", str(model_dir), "--step-ms", str(step_ms)]
        engine = _spawn([*command, "--tokens-per-chunk", str(per_chunk)])
        model: dict[str, object] = {
            "name": MODEL,
            "upstream": "vllm-grpc",
            "tokenizer": str(
                tools_tokenizer(model_dir, model_dir.parent / "tools") if tools else model_dir
            ),
            "tool_call_parser": "hermes",
            "workers": [f"127.0.0.1:{port}"],
        }
    else:
        command = ["-m", "benchmarks.fake_openai", "--port", str(port), "--model", MODEL]
        engine = _spawn([*command, "--step-ms", str(step_ms)])
        model = {"name": MODEL, "upstream": "openai", "workers": [f"http://127.0.0.1:{port}/v1"]}
    stack.callback(_stop, engine)
    return model


def start_gateway(
    stack: ExitStack,
    model: dict[str, object],
    work: Path,
    source: Path,
    env: dict[str, str] | None = None,
) -> tuple[str, int]:
    """A gateway (the package in `source`, with `env` over this process's environment)
    serving `model`, ready: its URL and pid."""
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning", "models": [model]}
    (work / f"gateway-{port}.yaml").write_text(yaml.safe_dump(config))
    command = [
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--config",
        str(work / f"gateway-{port}.yaml"),
    ]
    gateway = subprocess.Popen(command, cwd=source, env={**os.environ, **(env or {})})
    stack.callback(_stop, gateway)
    _wait(lambda: _gateway_ready(port), gateway, "the gateway")
    return f"http://127.0.0.1:{port}", gateway.pid


def export(revision: str, into: Path) -> Path:
    """The directory holding the gateway package as committed at `revision` (or
    `revision` itself, a directory holding a `gateway` package)."""
    if (Path(revision) / "gateway").is_dir():
        return Path(revision)
    into.mkdir()
    archive = subprocess.run(
        ["git", "archive", revision, "gateway"], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


#: More fields of every request (`--max-tokens`).
EXTRA: dict[str, object] = {}


def answer_length(path: str, max_tokens: int) -> None:
    """Every request asks `max_tokens` (`EXTRA`); and on the `http` path, where
    fake_openai echoes the message's words, one a token, says as many words."""
    EXTRA["max_tokens"] = max_tokens
    if path == "http":
        EXTRA["messages"] = [{"role": "user", "content": " ".join(["word"] * max_tokens)}]


def load(url: str, streams: int, requests: int, tools: bool) -> Sample:
    extra = {"tools": [TOOL], "tool_choice": "auto", **EXTRA} if tools else EXTRA
    return asyncio.run(run_load(lambda: HttpCalls(url, extra), streams, requests))


def top_functions(collapsed: Path, count: int = 25) -> str:
    """The functions with the most samples, by own time and inclusive, from py-spy's
    collapsed stacks (`frame;frame;... N` a line)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        samples = int(n)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    if not total:
        return "no samples"
    lines = [f"{total} samples; own time:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(count)]
    lines += ["inclusive:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(count)]
    return "\n".join(lines)


def profile(pid: int, out: Path, url: str, streams: int, requests: int, tools: bool) -> None:
    """One load under py-spy (collapsed stacks and speedscope), its top functions printed."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    for fmt, suffix in (("raw", "txt"), ("speedscope", "json")):
        target = out / f"{streams}-streams.{suffix}"
        command = [py_spy, "record", "--pid", str(pid), "--rate", "1000", "--format", fmt]
        command += ["--output", str(target), "--nonblocking", "--gil"]
        recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attaches
        load(url, streams, requests, tools)
        recorder.send_signal(2)  # SIGINT: py-spy writes its file and exits
        recorder.wait(30)
    print(f"\n--- py-spy, {streams} streams (GIL held) ---")
    print(top_functions(out / f"{streams}-streams.txt"))


def loop_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread, the one that runs the event loop (the
    rest of `process_cpu` is gRPC's threads: its I/O and its completion-queue poller)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as stat:
            return int(stat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


#: One load of a target: streams, requests -> what was measured.
Load = Callable[[int, int], Sample]


def gateway_load(url: str, tools: bool) -> Load:
    """Streamed chat completions through the gateway at `url` (clients in this process)."""
    return lambda streams, requests: load(url, streams, requests, tools)


def raw_grpc_load(address: str, model_dir: Path) -> Load:
    """`bench_vllm`'s raw client (grpc.aio, token ids in, incremental decoding), in this
    process, against the stand-in at `address`: its CPU is the floor a Python client of
    the gRPC stream pays, one `read` a message, before any of the gateway's work."""
    tokenizer = load_tokenizer(str(model_dir))
    ids = tokenizer.encode("Tell me about the gateway.", add_special_tokens=True)
    return lambda streams, requests: asyncio.run(
        run_load(lambda: GrpcCalls(address, ids, tokenizer), streams, requests)
    )


def measure(pid: int, run: Load, streams: int, requests: int) -> tuple[float, float, Sample]:
    """One load; the CPU seconds of process `pid` over it, all threads and the loop's."""
    before, loop_before = process_cpu(pid) or 0.0, loop_cpu(pid)
    sample = run(streams, requests)
    return (process_cpu(pid) or 0.0) - before, loop_cpu(pid) - loop_before, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--requests", type=int, default=200, help="requests per load")
    parser.add_argument("--tools", action="store_true", help="requests carry a tool")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens an answer")
    parser.add_argument(
        "--step-ms", type=float, default=STEP_MS, help="the stand-in's ms per token (a step)"
    )
    parser.add_argument(
        "--tokens-per-chunk", type=int, default=1, help="grpc: the stand-in's tokens a message"
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="every request asks chunks of this many tokens (vLLM's stream_interval)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the gateway as committed at REV, interleaved",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in the working tree's gateway only (against --baseline: a setting's effect)",
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="grpc: also a raw grpc.aio client in this process, the floor of a Python client",
    )
    parser.add_argument("--py-spy", type=Path, help="profile into this directory too")
    args = parser.parse_args()
    answer_length(args.path, args.max_tokens)
    if args.stream_interval > 1:
        EXTRA["stream_interval"] = args.stream_interval
    with tempfile.TemporaryDirectory(prefix="profile-gateway-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = build_vllm_model(work / "model")
        (work / "tools").mkdir()
        model = start_engine(
            stack, args.path, model_dir, args.tools, args.step_ms, args.tokens_per_chunk
        )
        env = dict(item.split("=", 1) for item in args.env)
        url, pid = start_gateway(stack, model, work, ROOT, env)
        gateways: dict[str, tuple[Load, int]] = {
            "working tree": (gateway_load(url, args.tools), pid)
        }
        if args.baseline:
            source = export(args.baseline, work / "baseline")
            other, other_pid = start_gateway(stack, model, work, source)
            gateways[args.baseline] = (gateway_load(other, args.tools), other_pid)
        if args.raw and args.path == "grpc":
            workers = cast(list[str], model["workers"])
            gateways["raw grpc.aio client"] = (raw_grpc_load(workers[0], model_dir), os.getpid())
        for run, _ in gateways.values():
            run(8, 32)  # warm
        print(f"\n{args.path} path, {args.requests} requests a load and round, tools: {args.tools}")
        cpu: dict[tuple[str, int], list[float]] = {(g, s): [] for g in gateways for s in LOADS}
        tokens: dict[tuple[str, int], list[float]] = {(g, s): [] for g in gateways for s in LOADS}
        looped: dict[tuple[str, int], list[float]] = {(g, s): [] for g in gateways for s in LOADS}
        ttft: dict[tuple[str, int], list[float]] = {(g, s): [] for g in gateways for s in LOADS}
        for round_ in range(args.rounds):
            for streams in LOADS:
                turns = list(gateways.items())
                for name, (run, measured) in turns[::-1] if round_ % 2 else turns:  # A B, B A
                    seconds, loop, sample = measure(measured, run, streams, args.requests)
                    cpu[name, streams].append(seconds / sample.requests * 1e6)
                    tokens[name, streams].append(seconds / sample.tokens * 1e6)
                    looped[name, streams].append(loop / sample.tokens * 1e6)
                    ttft[name, streams].append(sample.p50 * 1e3)
        columns = "TTFT p50 | CPU per request | CPU per token | of it the loop's"
        print(f"| target | streams | {columns} |")
        print("| --- | --- | --- | --- | --- | --- |")
        for (name, streams), per_request in cpu.items():
            print(
                f"| {name} | {streams} | {spread(ttft[name, streams], '.2f')} ms "
                f"| {spread(per_request, '.0f')} µs "
                f"| {spread(tokens[name, streams], '.1f')} µs "
                f"| {spread(looped[name, streams], '.1f')} µs |"
            )
        if args.py_spy:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            for streams in LOADS:
                profile(pid, args.py_spy, url, streams, args.requests, args.tools)


if __name__ == "__main__":
    main()
