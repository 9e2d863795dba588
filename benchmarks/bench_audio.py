"""What the gateway adds to a transcription: vLLM's CPU build serving a tiny Whisper
(tests/support/tiny_whisper.py), reached directly and through furnace-gateway
(`upstream: openai`), with forms of a short and a long audio file, interleaved rounds.

    python -m benchmarks.bench_audio [--requests 16] [--rounds 3] [--seconds 1.5,30]

Prints, per file and target, the wall time p50 of a whole transcription (`json`, 8
tokens written) and of a stream's first event, the gateway's added time (its median
against the direct median of the same round) and the gateway's CPU per request (its
process's user + system time over the round, divided by the requests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.tiny_whisper import build_tiny_whisper, wav  # noqa: E402
from tests.support.vllm import start_lean_http_server  # noqa: E402

MODEL = "tiny-whisper"
STARTUP_TIMEOUT = 60.0
FORM = {"model": MODEL, "language": "en", "max_completion_tokens": "8"}


def _cpu(pid: int) -> float:
    """A process's user + system CPU seconds so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway(stack: ExitStack, work: Path, upstream: str) -> tuple[str, int]:
    """A furnace-gateway process with the speech model, ready: its URL and pid."""
    port = free_port()
    model = {"name": MODEL, "upstream": "openai", "workers": [upstream]}
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning", "models": [model]}
    (work / "gateway.yaml").write_text(yaml.safe_dump(config))
    gateway = _spawn(["-m", "gateway", "serve", "--config", str(work / "gateway.yaml")])
    stack.callback(_stop, gateway)
    end = time.monotonic() + STARTUP_TIMEOUT
    while not _gateway_ready(port):
        if time.monotonic() > end or gateway.poll() is not None:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.2)
    return f"http://127.0.0.1:{port}", gateway.pid


def _timed(client: httpx.Client, audio: bytes, stream: bool) -> float:
    """Seconds to the whole answer, or to a stream's first event."""
    files = {"file": ("speech.wav", audio, "audio/wav")}
    start = time.perf_counter()
    if not stream:
        client.post("/v1/audio/transcriptions", data=FORM, files=files).raise_for_status()
        return time.perf_counter() - start
    data = {**FORM, "stream": "true"}
    with client.stream("POST", "/v1/audio/transcriptions", data=data, files=files) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        next(lines)
        elapsed = time.perf_counter() - start
        for _ in lines:  # the rest of the stream
            pass
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="requests per target and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--seconds", default="1.5,30", help="the audio files' lengths")
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model = build_tiny_whisper(work / "model")
        server = start_lean_http_server(model, work, MODEL)
        stack.callback(server.stop)
        direct = f"http://127.0.0.1:{server.port}"
        url, pid = _gateway(stack, work, f"{direct}/v1")
        headers = {"authorization": "Bearer unused"}
        targets = {
            "direct": httpx.Client(base_url=direct, timeout=120),
            "furnace-gateway": httpx.Client(base_url=url, timeout=120, headers=headers),
        }
        for client in targets.values():
            stack.callback(client.close)
        print("| audio | answer | target | p50 ms | added ms (rounds) | gateway CPU ms a request |")
        print("| --- | --- | --- | ---: | --- | ---: |")
        for seconds in map(float, args.seconds.split(",")):
            audio = wav(seconds)
            for stream in (False, True):
                _rounds(
                    targets, audio, stream, args, pid, f"{seconds:g} s ({len(audio) >> 10} KiB)"
                )


def _rounds(
    targets: dict[str, httpx.Client],
    audio: bytes,
    stream: bool,
    args: argparse.Namespace,
    pid: int,
    label: str,
) -> None:
    """`args.rounds` interleaved rounds of each target; one row a target."""
    medians: dict[str, list[float]] = {name: [] for name in targets}
    cpu: list[float] = []
    for client in targets.values():
        _timed(client, audio, stream)  # warm: the connection, the engine's shapes
    for _ in range(args.rounds):
        for name, client in targets.items():
            before = _cpu(pid)
            times = [_timed(client, audio, stream) for _ in range(args.requests)]
            if name != "direct":
                cpu.append((_cpu(pid) - before) / args.requests)
            medians[name].append(statistics.median(times))
    answer = "stream, first event" if stream else "json, whole"
    added = [t - d for t, d in zip(medians["furnace-gateway"], medians["direct"], strict=True)]
    show: Callable[[float], str] = lambda s: f"{s * 1000:+.1f}"  # noqa: E731
    for name, rounds in medians.items():
        extra = (
            ""
            if name == "direct"
            else f"{show(statistics.median(added))} ({', '.join(map(show, added))})"
        )
        used = "" if name == "direct" else f"{statistics.median(cpu) * 1000:.2f}"
        p50 = statistics.median(rounds) * 1000
        print(f"| {label} | {answer} | {name} | {p50:.1f} | {extra} | {used} |")


if __name__ == "__main__":
    main()
