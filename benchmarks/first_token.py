"""Where furnace-gateway's time to first token goes: one request at a time, each step
of the request inside the gateway timed, beside a raw client's time to first text for
the same prompt, alternating with it in the same run. Two paths (`--path`):

- `grpc` (the default): `upstream: vllm-grpc` in front of vLLM's gRPC server, beside a
  raw grpc.aio client sending the token ids (the steps: the worker picked, the call's
  start, the model's info, the template rendered, the prompt tokenized, the gRPC call
  made, the engine's first message, the message with the first text);
- `http`: `upstream: openai` in front of vLLM's OpenAI server, beside a streamed chat
  sent to that server directly (the steps: the worker picked, the request built and
  written on the kept-alive connection, the engine's first read, the read with the
  first text).

Both share the edge's steps: the request's first bytes read, its head parsed, the app
called, the body read and parsed, admitted, the fleet's try; then the response's head and
the first text's SSE write. With `--stand-in STEP_MS` the engine is `bench_vllm`'s
stand-in (a token each STEP_MS, almost no CPU), so the gateway's own work is what is
left. With `--relay` (`http`) the same pairs are then measured with `bench_edge_floor`'s
bare TCP relay in the gateway's place: a uvloop process that copies bytes both ways and
parses nothing, so its added TTFT is what the two extra hops and any Python process on
the path cost, before any work.

The gateway runs as `python -m benchmarks.first_token serve --config FILE`: `gateway serve`
with the steps of its first-token path wrapped to note the time (`time.monotonic_ns`, one
clock for every process of the machine, so the client's and the gateway's marks line up)
and the process's CPU (`time.process_time_ns`, every thread, gRPC's own too) at some of
them; each request's marks go to `$FIRST_TOKEN_MARKS` as a JSON line. The wrappers cost a
few µs a step.

On a 2-core machine vLLM's CPU build runs its forward passes on both cores (OpenMP), so
any CPU another process takes while the engine works delays the engine's steps: the
gateway's CPU between the call and the first text is time added to the first token, not
only its own wall time before the call.

Run: `.venv/bin/python -m benchmarks.first_token [--path grpc|http] [--stand-in STEP_MS]
[--requests N] [--relay]` (about 2 minutes on a quiet 2-core machine against vLLM, most of it
vLLM's start; under a minute against a stand-in). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MARKS_ENV = "FIRST_TOKEN_MARKS"
PATH_ENV = "FIRST_TOKEN_PATH"
#: The marks at which the gateway's CPU is read too.
CPU_AT = ("recv", "app", "tokenized", "call_made", "msg1", "resp_start", "msg_text", "sse_sent")
#: The edge's steps, on both paths (a pair of marks each).
EDGE_STEPS = (
    ("t0", "recv", "client's write, loopback, the loop's wake-up"),
    ("recv", "head", "head parsed (httptools)"),
    ("head", "headed", "uvicorn's scope, cycle and task; the edge's timers"),
    ("headed", "checks", "body callbacks, the loop's turn, the task's start"),
    ("checks", "app", "host, key and content-type checks"),
    ("app", "body", "body read"),
    ("body", "parsed", "body parsed and checked"),
    ("parsed", "admitted", "limits, admission"),
    ("admitted", "try", "the fleet's start"),
    ("try", "picked", "routing, pick"),
)
#: The steps reported, in the order of a request, by path.
STEPS = {
    "grpc": (
        *EDGE_STEPS,
        ("picked", "start", "call object, first read"),
        ("start", "model_info", "choices, model info (cached)"),
        ("model_info", "rendered", "chat template"),
        ("rendered", "tokenized", "tokenizing"),
        ("tokenized", "call_made", "message, grpc.aio call made"),
        ("call_made", "msg1", "engine: prefill, first message"),
        ("msg1", "msg_text", "engine: messages up to the first text"),
        ("msg_text", "sse_sent", "reader, first SSE write (Started, head: at the grace)"),
        ("sse_sent", "text", "client reads the text"),
    ),
    "http": (
        *EDGE_STEPS,
        ("picked", "call_made", "request built, written on a kept-alive connection"),
        ("call_made", "msg1", "engine: its first read (the response's head)"),
        ("msg1", "msg_text", "engine: prefill, the read with the first text"),
        ("msg_text", "sse_sent", "parsed, first SSE write (Started, head: at the grace)"),
        ("sse_sent", "text", "client reads the text"),
    ),
}


# --- inside the gateway --------------------------------------------------------------------


class Marks:
    """The marks of the request in flight (one at a time); each step noted once."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.current: dict[str, int] = {}
        self.pending: dict[str, int] = {}  # read before the app knows of the request

    def mark(self, name: str) -> None:
        if name not in self.current:
            self.current[name] = time.monotonic_ns()
            if name in CPU_AT:
                self.current["cpu_" + name] = time.process_time_ns()

    def begin(self) -> None:
        self.current, self.pending = self.pending, {}
        self.mark("app")

    def end(self) -> None:
        with self.out.open("a") as out:
            out.write(json.dumps(self.current) + "\n")


def _wrap(owner: Any, attribute: str, marks: Marks, before: str = "", after: str = "") -> None:
    """`owner.attribute` noting `before` when called and `after` when it returns."""
    original = getattr(owner, attribute)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            if before:
                marks.mark(before)
            result = await original(*args, **kwargs)
            if after:
                marks.mark(after)
            return result

    else:

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before:
                marks.mark(before)
            result = original(*args, **kwargs)
            if after:
                marks.mark(after)
            return result

    setattr(owner, attribute, timed)


def instrument(marks: Marks, path: str) -> None:
    """Wraps the steps of the first-token path of chat completions on `path`."""
    from gateway import fleet
    from gateway.edge import http_protocol, middleware, request
    from gateway.edge.openai import generation

    protocol = http_protocol.GuardedHttpProtocol
    data_received, headers_complete = protocol.data_received, protocol.on_headers_complete

    def received(self: Any, data: bytes) -> None:
        if b"/chat/completions" in data[:64]:
            marks.pending = {"recv": time.monotonic_ns(), "cpu_recv": time.process_time_ns()}
        data_received(self, data)

    def head(self: Any) -> None:
        marks.pending.setdefault("head", time.monotonic_ns())
        headers_complete(self)
        marks.pending.setdefault("headed", time.monotonic_ns())

    protocol.data_received, protocol.on_headers_complete = received, head  # type: ignore[method-assign]

    exact_call = middleware.ExactRoutes.__call__

    async def exact(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope["path"].endswith("/chat/completions"):
            marks.pending.setdefault("checks", time.monotonic_ns())
        await exact_call(self, scope, receive, send)

    middleware.ExactRoutes.__call__ = exact  # type: ignore[method-assign]
    route_call = request.RequestRoute.__call__

    async def routed(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if not scope["path"].endswith("/chat/completions"):
            return await route_call(self, scope, receive, send)
        marks.begin()

        async def timed_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                marks.mark("resp_start")
            elif (body := message.get("body", b"")).count(_HAS_TEXT) > body.count(_NO_TEXT):
                await send(message)
                marks.mark("sse_sent")
                return
            await send(message)

        try:
            await route_call(self, scope, receive, timed_send)
        finally:
            marks.end()

    request.RequestRoute.__call__ = routed  # type: ignore[method-assign]
    write_now = http_protocol._WriteNow.write

    def written_now(self: Any, body: bytes) -> None:  # a text the pump's sink wrote
        write_now(self, body)
        if body.count(_HAS_TEXT) > body.count(_NO_TEXT):
            marks.mark("sse_sent")

    http_protocol._WriteNow.write = written_now  # type: ignore[method-assign]
    _wrap(generation, "read_json", marks, after="body")
    _wrap(generation.GenerationRoute, "parse_body", marks, after="parsed")
    _wrap(generation.GenerationRoute, "_serve", marks, before="admitted")
    _wrap(fleet.Fleet, "_try", marks, before="try", after="started")
    (_instrument_grpc if path == "grpc" else _instrument_http)(marks)


#: What a chunk with text (not the role's empty content) holds, in the gateway's
#: answer and in an OpenAI server's.
_HAS_TEXT = b'"content":"'
_NO_TEXT = b'"content":""'


def _instrument_grpc(marks: Marks) -> None:
    """The `vllm-grpc` upstream's steps."""
    from gateway.protocol.types import Text
    from gateway.tokenization import tokenizer
    from gateway.upstreams import vllm_grpc

    _wrap(vllm_grpc.VllmGrpcUpstream, "call", marks, before="picked")
    _wrap(vllm_grpc.VllmGrpcCall, "_start", marks, before="start", after="call_made")
    _wrap(vllm_grpc.VllmGrpcUpstream, "model_info", marks, after="model_info")
    _wrap(tokenizer.ModelTokenizer, "render_chat", marks, after="rendered")
    _wrap(vllm_grpc.VllmGrpcUpstream, "prompt_ids", marks, after="tokenized")
    take = vllm_grpc.VllmGrpcCall._take

    def taken(self: Any, message: Any) -> None:
        marks.mark("msg1")
        before = len(self._pending)
        take(self, message)
        if any(type(e) is Text for e in list(self._pending)[before:]):
            marks.mark("msg_text")

    vllm_grpc.VllmGrpcCall._take = taken  # type: ignore[method-assign]


def _instrument_http(marks: Marks) -> None:
    """The `openai` upstream's steps, on its raw HTTP/1.1 connections."""
    from gateway.protocol import http1
    from gateway.upstreams.openai_http import upstream

    _wrap(upstream.OpenAIHttpUpstream, "call", marks, before="picked")
    _wrap(http1.Connection, "send", marks, after="call_made")
    read = http1.Connection.data_received

    def read_timed(self: Any, data: bytes) -> None:
        marks.mark("msg1")
        if data.count(_HAS_TEXT) > data.count(_NO_TEXT):
            marks.mark("msg_text")
        read(self, data)

    http1.Connection.data_received = read_timed  # type: ignore[method-assign]


def serve(argv: list[str]) -> None:
    """`gateway serve`, instrumented."""
    instrument(Marks(Path(os.environ[MARKS_ENV])), os.environ.get(PATH_ENV, "grpc"))
    from gateway.cli import main

    main(["serve", *argv])


# --- the measuring side --------------------------------------------------------------------


async def _raw(stub: Any, ids: list[int], tokenizer: Any) -> dict[str, int]:
    """A raw grpc.aio call (as bench_vllm's direct client): its start, first message and
    first text, and its own CPU to the first text."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    from benchmarks.bench_vllm import MAX_TOKENS

    request = pb.GenerateRequest(
        request_id=f"first-token-{time.monotonic_ns()}",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        stream=True,
    )
    marks = {"t0": time.monotonic_ns(), "cpu_t0": time.process_time_ns()}
    decoder = tokenizer.detokenizer()
    async for reply in stub.Generate(request, timeout=120):
        if reply.WhichOneof("response") != "chunk":
            continue
        marks.setdefault("msg1", time.monotonic_ns())
        if decoder.feed(reply.chunk.token_ids) and "text" not in marks:
            marks["text"], marks["cpu_text"] = time.monotonic_ns(), time.process_time_ns()
    return marks


async def _through(client: Any, url: str, extra: Any = None) -> dict[str, int]:
    """A streamed chat completion to `url` (a gateway, or the OpenAI server directly):
    its start and first text (`extra`: fields of the request)."""
    from benchmarks.bench_vllm import chat_body

    body = chat_body(extra)
    marks = {"t0": time.monotonic_ns()}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if "text" not in marks and '"content":"' in line and '"content":""' not in line:
                marks["text"] = time.monotonic_ns()
    return marks


async def measure(
    path: str, engine: str, url: str, model_dir: Path, requests: int, extra: Any = None
) -> list[Any]:
    """`requests` pairs (raw, through the gateway), after 3 to warm up; the raw client
    is grpc.aio at `engine` (an address) or a streamed chat to `engine` (a URL)."""
    import grpc
    import httpx
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    from benchmarks.bench_vllm import MESSAGES
    from gateway.protocol.types import Message
    from gateway.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    ids = tokenizer.prompt_ids(None, [Message(m["role"], m["content"]) for m in MESSAGES])
    pairs = []
    async with (
        grpc.aio.insecure_channel(engine) as channel,
        httpx.AsyncClient(timeout=120) as client,
    ):
        stub = pb_grpc.VllmEngineStub(channel)
        for i in range(requests + 3):
            if path == "grpc":
                raw = await _raw(stub, ids, tokenizer)
            else:
                raw = await _through(client, engine, extra)
            through = await _through(client, url, extra)
            if i >= 3:
                pairs.append((raw, through))
    return pairs


def added_ttft(pairs: list[Any]) -> tuple[list[int], list[int], list[int]]:
    """The raw client's TTFTs, those through the front, and the paired differences (ns)."""
    raw = [r["text"] - r["t0"] for r, _ in pairs]
    through = [t["text"] - t["t0"] for _, t in pairs]
    return raw, through, [t - r for t, r in zip(through, raw, strict=True)]


def report(path: str, pairs: list[Any], inside: list[dict[str, int]]) -> None:
    """Each step's median, the TTFTs and the gateway's CPU by stretch."""

    def us(values: list[float]) -> str:
        return f"{statistics.median(values) / 1e3:8.1f} µs" if values else "     n/a"

    joined = [
        {**marks, "t0": through["t0"], "text": through["text"]}
        for (_, through), marks in zip(pairs, inside, strict=True)
    ]
    print(f"\n{path}: {len(pairs)} requests, one at a time; medians\n")
    print("| step | what | p50 |")
    print("| --- | --- | --- |")
    for start, end, what in STEPS[path]:
        values = [m[end] - m[start] for m in joined if start in m and end in m]
        print(f"| {start} → {end} | {what} | {us(values)} |")
    raw_ttft, gateway_ttft, added = added_ttft(pairs)
    print(
        f"\nraw client TTFT {us(raw_ttft)}, through the gateway {us(gateway_ttft)}, "
        f"added (paired) {us(added)}"
    )
    if path == "grpc":
        print(
            f"raw client to its first message {us([r['msg1'] - r['t0'] for r, _ in pairs])}, "
            f"first message to text {us([r['text'] - r['msg1'] for r, _ in pairs])}, "
            f"its CPU to the first text {us([r['cpu_text'] - r['cpu_t0'] for r, _ in pairs])}"
        )

    def cpu(a: str, b: str) -> str:
        values = [
            m["cpu_" + b] - m["cpu_" + a] for m in joined if "cpu_" + a in m and "cpu_" + b in m
        ]
        return f"{a} → {b} {us(values).strip()}"

    stretches = [("recv", "app"), ("recv", "call_made"), ("call_made", "msg1")]
    stretches += [("msg1", "msg_text"), ("msg_text", "sse_sent"), ("recv", "sse_sent")]
    print("gateway CPU: " + ", ".join(cpu(a, b) for a, b in stretches))
    wall = [m["call_made"] - m["recv"] for m in joined if "call_made" in m]
    print(f"gateway wall time from the request's bytes to the call made: {us(wall).strip()}")


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--requests", type=int, default=40, help="requests of each kind")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument(
        "--relay",
        action="store_true",
        help="http: then the same pairs through a bare TCP relay in the gateway's place",
    )
    parser.add_argument(
        "--stand-in",
        type=float,
        metavar="STEP_MS",
        help="front bench_vllm's stand-in of the engine, a token every STEP_MS ms",
    )
    args = parser.parse_args()

    import yaml

    from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop
    from benchmarks.bench_vllm import MODEL, STARTUP_TIMEOUT, Engine
    from tests.support import vllm as vllm_support
    from tests.support.processes import free_port

    vllm_support.START_GUARD = args.start_timeout
    with tempfile.TemporaryDirectory(prefix="first-token-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model_dir = vllm_support.build_vllm_model(work / "model")
        engine = Engine(model_dir, work, args.stand_in)
        print(f"starting the engine ({args.path})", file=sys.stderr, flush=True)
        server = engine.grpc() if args.path == "grpc" else engine.http()
        stack.callback(server.stop)
        if args.path == "grpc":
            address = f"127.0.0.1:{server.port}"
            model = {"name": MODEL, "upstream": "vllm-grpc", "tokenizer": str(model_dir)}
            model["workers"] = [address]
            extra = None
        else:
            address = f"http://127.0.0.1:{server.port}"
            model = {"name": MODEL, "upstream": "openai", "workers": [address + "/v1"]}
            extra = engine.http_body
        port = free_port()
        config = {
            "host": "127.0.0.1",
            "port": port,
            "log_level": "warning",
            "start_timeout": 300,
            "models": [model],
        }
        (work / "gateway.yaml").write_text(yaml.safe_dump(config))
        marks_file = work / "marks.jsonl"
        os.environ[MARKS_ENV], os.environ[PATH_ENV] = str(marks_file), args.path
        gateway = _spawn(
            ["-m", "benchmarks.first_token", "serve", "--config", str(work / "gateway.yaml")]
        )
        stack.callback(_stop, gateway)
        end = time.monotonic() + STARTUP_TIMEOUT
        while not _gateway_ready(port):
            if time.monotonic() > end or gateway.poll() is not None:
                raise SystemExit("the gateway did not start")
            time.sleep(0.2)
        print("measuring", file=sys.stderr, flush=True)
        url = f"http://127.0.0.1:{port}"
        pairs = asyncio.run(measure(args.path, address, url, model_dir, args.requests, extra))
        inside = [json.loads(line) for line in marks_file.read_text().splitlines()]
        report(args.path, pairs, inside[-len(pairs) :])
        if args.relay and args.path == "http":
            relay_ttft(stack, server.port, model_dir, args.requests, extra)


def relay_ttft(
    stack: ExitStack, engine_port: int, model_dir: Path, requests: int, extra: Any
) -> None:
    """The same pairs with `bench_edge_floor`'s bare TCP relay in the gateway's place."""
    import socket

    from benchmarks.bench_gateway import _spawn, _stop
    from tests.support.processes import free_port

    port = free_port()
    relay = _spawn(["-m", "benchmarks.bench_edge_floor", "--relay", str(port), str(engine_port)])
    stack.callback(_stop, relay)
    end = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > end or relay.poll() is not None:
                raise SystemExit("the relay did not start") from None
            time.sleep(0.1)
    engine, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    pairs = asyncio.run(measure("http", engine, url, model_dir, requests, extra))
    raw, through, added = added_ttft(pairs)
    ms = statistics.median
    print(
        f"\nbare TCP relay in its place ({len(pairs)} pairs): raw client TTFT "
        f"{ms(raw) / 1e3:.1f} µs, through the relay {ms(through) / 1e3:.1f} µs, "
        f"added (paired) {ms(added) / 1e3:.1f} µs"
    )


if __name__ == "__main__":
    main()
