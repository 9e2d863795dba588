"""GenerateMultiplexed, both ends over real gRPC: the worker SDK's side driven
by a raw client (each request keeps Generate's contract in-band; batching, the
window, cancellation, deadlines, the call's own rules), and the gateway's side
(every request to a worker on one call; per-request calls when turned off)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from gateway.config import ModelConfig
from gateway.protocol import errors
from gateway.protocol.convert import event_to_proto
from gateway.protocol.grpc_options import CHANNEL_OPTIONS
from gateway.protocol.multiplex import WINDOW, units
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.upstreams import furnace_multiplex
from gateway.upstreams.furnace_multiplex import MultiplexLink
from gateway.worker.demo import DemoEngine
from gateway.worker.engine import Engine
from gateway.worker.servicer import READ_AHEAD_CHARS
from tests.support.script_engine import ScriptEngine
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.waiting import HANG_GUARD, wait_until


class RawCall:
    """A GenerateMultiplexed call as a test drives it: what it sends, and what
    came back for each stream id."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.EngineStub(channel).GenerateMultiplexed()
        self.events: dict[int, list[pb.GenerateEvent]] = {}
        self.ends: dict[int, pb.MultiplexEnd] = {}
        self.responses = 0

    async def start(self, *streams: int, timeout_ms: int = 0, **request: object) -> None:
        """Starts a request (the same) as each of `streams`, in one message."""
        request.setdefault("text", "x")
        starts = [
            pb.MultiplexStart(
                stream=s, request=pb.GenerateRequest(**request), timeout_ms=timeout_ms
            )
            for s in streams
        ]
        await self.call.write(pb.MultiplexRequest(starts=starts))

    async def read(self) -> bool:
        """Reads one response; False at the end of the call."""
        response = await self.call.read()
        if response is grpc.aio.EOF:
            return False
        self.responses += 1
        for event in response.events:
            if event.WhichOneof("body") == "end":
                self.ends[event.stream] = event.end
            else:
                self.events.setdefault(event.stream, []).append(event.event)
        return True

    async def until_ended(self, *streams: int) -> None:
        while not all(s in self.ends for s in streams):
            assert await self.read(), "the call ended first"

    def units(self, stream: int) -> int:
        return sum(units(e) for e in self.events.get(stream, []))


async def on_call(address: str, test) -> object:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(address) as channel:
        return await asyncio.wait_for(test(RawCall(channel)), HANG_GUARD)


async def generate(address: str, **request: object) -> tuple[list, grpc.aio.AioRpcError | None]:
    """The same request by Generate: its events and the status that ended it."""
    request.setdefault("text", "x")
    async with grpc.aio.insecure_channel(address) as channel:
        events: list = []
        try:
            async for event in pb_grpc.EngineStub(channel).Generate(
                pb.GenerateRequest(**request), timeout=HANG_GUARD
            ):
                events.append(event)
        except grpc.aio.AioRpcError as error:
            return events, error
        return events, None


# -- each request keeps Generate's contract -------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        errors.TooLong("too long"),
        errors.Invalid("bad", param="top_k"),
        errors.Busy("full"),
        errors.Unavailable("down"),
        errors.Failed("broken"),
        RuntimeError("a bug"),
    ],
)
def test_refusals_and_failures_end_a_request_as_generate_would(server_loop, serve_engines, error):
    for events in ([error], [Started(1), Text("a", 1), error]):
        worker = serve_engines(ScriptEngine(events))[0]

        async def run(call: RawCall) -> RawCall:
            await call.start(1, 2)  # two alike, side by side
            await call.until_ended(1, 2)
            return call

        received, failure = server_loop.call(generate(worker.address))
        call = server_loop.call(on_call(worker.address, run))
        assert failure is not None
        for stream in (1, 2):
            end = call.ends[stream]
            assert end.code == failure.code().value[0]
            assert end.message == failure.details()
            assert end.param == ("top_k" if isinstance(error, errors.Invalid) else "")
            assert call.events.get(stream, []) == received
        if isinstance(error, RuntimeError):
            assert "a bug" not in call.ends[1].message


def test_answers_are_generates_answers(server_loop, workers):
    requests = [
        {"text": "one two three four"},
        {"text": "a b c STOP d", "stop": ["STOP"]},
        {"text": "x y z", "n": 3},
        {"text": "p q", "logprobs": 2},
        {"model": "not-served"},
    ]

    async def run(call: RawCall) -> RawCall:
        for i, request in enumerate(requests, 1):
            await call.start(i, **request)
        await call.until_ended(*range(1, len(requests) + 1))
        return call

    call = server_loop.call(on_call(workers.demo.address, run))
    for i, request in enumerate(requests, 1):
        expected, failure = server_loop.call(generate(workers.demo.address, **request))
        got = call.events.get(i, [])
        # the same text per choice, tokens, finishes (messages may be cut apart differently)
        assert _answer(got) == _answer(expected)
        assert call.ends[i].code == (failure.code().value[0] if failure else 0)


def _answer(events: list[pb.GenerateEvent]) -> tuple:
    texts: dict[int, str] = {}
    tokens, logprobs, others = 0, [], []
    for event in events:
        if event.WhichOneof("event") == "text":
            texts[event.text.index] = texts.get(event.text.index, "") + event.text.text
            tokens += event.text.tokens
            logprobs += [lp.token for lp in event.text.logprobs]
        else:
            others.append(event)
            if event.WhichOneof("event") == "started":
                # the demo's prefix cache holds the prompt the second time it comes
                event.started.ClearField("cached_tokens")
    return texts, tokens, logprobs, sorted(e.SerializeToString() for e in others)


_TOP = tuple((f"alt{i}", -1.0 - i) for i in range(20))


@pytest.mark.parametrize(
    "event",
    [
        Started(3),
        Text("héllo", 2),
        Text("a", 1, 2, (TokenLogprob("a", -0.5, _TOP),)),
        ToolCallDelta(0, 0, "call_1", "f", '{"x": 1}', 3),
        Finished(FinishReason.STOP, 4),
    ],
)
def test_an_event_counts_every_byte_it_carries_against_the_window(event):
    message = event_to_proto(event)
    assert units(message) == len(message.SerializeToString())


def test_logprobs_count_against_the_window():
    # one character of text with 20 alternatives: counted by all it carries, not as 2
    plain = units(event_to_proto(Text("a", 1)))
    rich = units(event_to_proto(Text("a", 1, 0, (TokenLogprob("a", -0.5, _TOP),))))
    assert rich > plain + 20 * len("alt0")


# -- what the one call brings -----------------------------------------------------------


def test_requests_stepped_together_share_messages(server_loop, serve_engines):
    worker = serve_engines(DemoEngine("paced", token_delay=0.005))[0]
    streams = range(1, 17)

    async def run(call: RawCall) -> RawCall:
        await call.start(*streams, text=" ".join(f"w{i}" for i in range(20)))
        await call.until_ended(*streams)
        return call

    call = server_loop.call(on_call(worker.address, run))
    events = sum(len(call.events[s]) for s in streams)
    assert all(
        "".join(e.text.text for e in call.events[s] if e.WhichOneof("event") == "text")
        == " ".join(f"w{i}" for i in range(20))
        for s in streams
    )
    assert call.responses * 4 < events  # 16 requests, each step in about one message


def test_an_unread_request_stops_at_its_window_and_goes_on_with_credit(server_loop, serve_engines):
    engine = DemoEngine("long", max_context=1_000_000)
    worker = serve_engines(engine)[0]
    words = " ".join(f"word{i}" for i in range(100_000))  # ~990,000 characters

    async def run(call: RawCall) -> tuple[int, int, str]:
        await call.start(1, text=words, sampling=pb.SamplingParams(max_tokens=100_000))
        reader = asyncio.create_task(call.until_ended(1))  # (a read cancelled ends the call)
        while call.units(1) < WINDOW - READ_AHEAD_CHARS:  # noqa: ASYNC110 (a poll of a test)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # no credit returned: whatever else comes stays in the window
        held, running = call.units(1), engine.running
        credited = 0
        while not reader.done():
            owed = call.units(1) - credited
            if owed:
                credits = [pb.MultiplexCredit(stream=1, units=owed)]
                await call.call.write(pb.MultiplexRequest(credits=credits))
                credited += owed
            await asyncio.sleep(0.005)
        await reader
        texts = [e.text.text for e in call.events[1] if e.WhichOneof("event") == "text"]
        return held, running, "".join(texts)

    held, running, text = server_loop.call(on_call(worker.address, run))
    assert held <= WINDOW + READ_AHEAD_CHARS + 1  # at most one event past the window
    assert running == 1  # held back, not finished
    assert text == words  # then all of it, with credit


def test_cancel_stops_one_request_and_not_the_others(server_loop, workers):
    engine = workers.slow_engine
    aborted = engine.aborted

    async def run(call: RawCall) -> RawCall:
        await call.start(1, 2, text="a b c d")
        while len(call.events.get(1, [])) < 2:
            assert await call.read()
        await call.call.write(pb.MultiplexRequest(cancels=[1]))
        await call.until_ended(2)
        return call

    call = server_loop.call(on_call(workers.slow.address, run))
    assert 1 not in call.ends  # nothing more for a cancelled request
    assert call.ends[2].code == 0
    assert call.events[2][-1].finished.completion_tokens == 4
    wait_until(lambda: engine.aborted == aborted + 1, "the engine to stop the one")
    wait_until(lambda: engine.running == 0, "the engine to be idle")


def test_a_request_ends_at_its_deadline(server_loop, workers):
    engine = workers.slow_engine
    aborted = engine.aborted

    async def run(call: RawCall) -> RawCall:
        await call.start(1, timeout_ms=300, text="w " * 500)
        await call.until_ended(1)
        return call

    call = server_loop.call(on_call(workers.slow.address, run))
    assert call.ends[1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    wait_until(lambda: engine.aborted == aborted + 1, "the engine to stop")


@pytest.mark.parametrize("streams", [(1, 1), (0,)])
def test_a_stream_id_open_or_zero_ends_the_call(server_loop, workers, streams):
    async def run(call: RawCall) -> grpc.StatusCode:
        await call.start(*streams, text="w " * 50)
        try:
            while await call.read():
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    assert server_loop.call(on_call(workers.slow.address, run)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    wait_until(lambda: workers.slow_engine.running == 0, "the engine to be idle")


def test_closing_the_sending_side_lets_open_requests_finish(server_loop, workers):
    async def run(call: RawCall) -> RawCall:
        await call.start(1, text="a b c")
        await call.call.done_writing()
        while await call.read():
            pass
        return call

    call = server_loop.call(on_call(workers.slow.address, run))
    assert call.ends[1].code == 0
    assert call.events[1][-1].finished.completion_tokens == 3


def test_ending_the_call_stops_every_request_on_it(server_loop, workers):
    engine = workers.slow_engine
    aborted = engine.aborted

    async def run(call: RawCall) -> None:
        await call.start(1, 2, 3, text="w " * 100)
        while sum(len(v) for v in call.events.values()) < 6:
            assert await call.read()
        call.call.cancel()

    server_loop.call(on_call(workers.slow.address, run))
    wait_until(lambda: engine.aborted == aborted + 3, "the engine to stop all three")
    wait_until(lambda: workers.slow.service.active == 0, "the worker to be idle")


# -- the gateway's side ------------------------------------------------------------------


def _ask(url: str, prompts: list[str]) -> list[httpx.Response]:
    def one(prompt: str) -> httpx.Response:
        body = {"model": SCRIPTED_MODEL, "prompt": prompt, "stream": True}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_GUARD)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_the_gateway_sends_every_request_to_a_worker_on_one_call(gateway, workers):
    scripted = workers.scripted
    _ask(gateway.url, [script(texts=1)])  # the call is open
    opened = scripted.multiplexed_calls
    responses = _ask(gateway.url, [script(texts=3, delay=0.02)] * 12)
    assert all(r.status_code == 200 and "t2 " in r.text for r in responses)
    ids = [r.headers["x-request-id"] for r in responses]
    assert {scripted.rpcs[i] for i in ids} == {"GenerateMultiplexed"}
    assert scripted.multiplexed_calls == opened


def test_turned_off_each_request_is_a_call_of_its_own(gateway_with, workers):
    gateway = gateway_with(multiplex_workers=False)
    responses = _ask(gateway.url, [script(texts=2)] * 3)
    assert all(r.status_code == 200 for r in responses)
    assert {workers.scripted.rpcs[r.headers["x-request-id"]] for r in responses} == {"Generate"}


@pytest.fixture
def serve_raw(server_loop):  # type: ignore[no-untyped-def]
    """Serves a raw Engine servicer (not the SDK) on a loopback port; stops it after."""
    servers: list[grpc.aio.Server] = []

    async def start(servicer: pb_grpc.EngineServicer) -> int:
        server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return port

    yield lambda servicer: server_loop.call(start(servicer))
    for server in servers:
        server_loop.call(server.stop(0))


class FloodingWorker(pb_grpc.EngineServicer):
    """Offers GenerateMultiplexed and ignores the window: four windows of text
    for every request, at once."""

    async def GenerateMultiplexed(self, requests, context):  # type: ignore[no-untyped-def]
        async for message in requests:
            for start in message.starts:
                started = pb.GenerateEvent(started=pb.Started(prompt_tokens=1))
                text = pb.GenerateEvent(text=pb.Text(text="x" * 4096, tokens=1))
                events = [pb.MultiplexEvent(stream=start.stream, event=started)]
                events += [pb.MultiplexEvent(stream=start.stream, event=text)] * 64
                await context.write(pb.MultiplexResponse(events=events))

    async def Describe(self, request, context):  # type: ignore[no-untyped-def]
        model = pb.ModelInfo(name="flood", max_context=100)
        return pb.DescribeResponse(models=[model], capacity=8, multiplex=True)


def test_a_worker_that_sends_past_the_window_fails_the_request(serve_raw, gateway_with):
    port = serve_raw(FloodingWorker())
    gateway = gateway_with(models=(ModelConfig("flood", workers=(f"127.0.0.1:{port}",)),))
    body = {"model": "flood", "prompt": "x"}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=HANG_GUARD)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "engine_error"


def test_a_stopping_worker_refuses_new_requests_and_finishes_the_open_ones(
    server_loop, serve_engines
):
    worker = serve_engines(DemoEngine("stopping", token_delay=0.05))[0]

    async def run(call: RawCall) -> RawCall:
        await call.start(1, text="a b c d e f")
        while len(call.events.get(1, [])) < 2:
            assert await call.read()
        stopping = asyncio.create_task(worker.stop(grace=HANG_GUARD))
        await asyncio.sleep(0)  # it has begun: NOT_SERVING, then draining
        await call.start(2, text="a b")
        await call.until_ended(1, 2)
        await stopping
        return call

    call = server_loop.call(on_call(worker.address, run))
    assert call.ends[1].code == 0
    assert call.events[1][-1].finished.completion_tokens == 6
    assert call.ends[2].code == grpc.StatusCode.UNAVAILABLE.value[0]  # retried elsewhere
    assert 2 not in call.events


class DeafWorker(pb_grpc.EngineServicer):
    """Offers GenerateMultiplexed, reads its first message, then reads nothing more
    and answers nothing (a stuck worker whose connection stays up)."""

    async def GenerateMultiplexed(self, requests, context):  # type: ignore[no-untyped-def]
        await anext(requests)
        await asyncio.sleep(3600)

    async def Describe(self, request, context):  # type: ignore[no-untyped-def]
        model = pb.ModelInfo(name="deaf", max_context=1_000_000)
        return pb.DescribeResponse(models=[model], capacity=64, multiplex=True)


def test_a_worker_that_stops_reading_fails_requests_and_holds_nothing(serve_raw, gateway_with):
    port = serve_raw(DeafWorker())
    gateway = gateway_with(
        models=(ModelConfig("deaf", workers=(f"127.0.0.1:{port}",)),),
        start_timeout=0.5,
        retry_attempts=1,
    )
    # 40 KB prompts: after the first two, the call's flow-control window is full and
    # the starts wait in the gateway until their requests give up
    prompts = ["w " * 20_000] * 6
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(
            pool.map(
                lambda prompt: httpx.post(
                    f"{gateway.url}/v1/completions",
                    json={"model": "deaf", "prompt": prompt},
                    timeout=HANG_GUARD,
                ),
                prompts,
            )
        )
    assert [r.status_code for r in responses] == [503] * len(prompts)
    assert {r.json()["error"]["code"] for r in responses} == {"engine_unavailable"}


# -- bounds on what one client can do to the call ----------------------------------------


class SizeEngine(Engine):
    """Answers the length of its prompt, as one token."""

    model = "big"
    max_context = 1 << 30

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        yield Started(1)
        yield Text(str(len(request.prompt or "")), 1)
        yield Finished(FinishReason.LENGTH, 1)


def test_starts_too_big_for_one_message_go_in_several(server_loop, serve_engines):
    # 17 starts of 4 MB in one turn of the loop were one message over gRPC's 64 MiB cap:
    # the call broke, and every request on it with the call
    worker = serve_engines(SizeEngine())[0]
    prompt = "x" * 4_000_000

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(worker.address, options=CHANNEL_OPTIONS) as channel:
            link = MultiplexLink(pb_grpc.EngineStub(channel), worker.address)
            request = GenerateRequest("big", prompt=prompt, sampling=SamplingParams(max_tokens=1))
            calls = [link.start(request, HANG_GUARD, (), lambda _: None) for _ in range(17)]
            texts = []
            for call in calls:
                texts.append("".join([e.text async for e in call if type(e) is Text]))
            await link.aclose()
            return texts

    texts = server_loop.call(asyncio.wait_for(run(), HANG_GUARD))
    assert texts == [str(len(prompt))] * 17


def test_a_start_bigger_than_any_message_is_refused_naming_its_prompt(gateway_with, monkeypatch):
    monkeypatch.setattr(furnace_multiplex, "MAX_START_BYTES", 1024 * 1024)
    gw = gateway_with()
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        too_big = {"messages": [{"role": "user", "content": "x" * 1_100_000}]}
        answer = client.post("/v1/chat/completions", json=too_big)
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "messages"
        answer = client.post("/v1/completions", json={"prompt": "y" * 1_100_000})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "prompt"
        assert client.post("/v1/completions", json={"prompt": "a b"}).is_success


class BreakingWorker(pb_grpc.EngineServicer):
    """Offers GenerateMultiplexed; once `count` requests are open on the call, it
    ends the call with INTERNAL (a worker whose call breaks under all of them)."""

    def __init__(self, count: int) -> None:
        self.count = count

    async def GenerateMultiplexed(self, requests, context):  # type: ignore[no-untyped-def]
        opened = 0
        async for message in requests:
            opened += len(message.starts)
            if opened >= self.count:
                await context.abort(grpc.StatusCode.INTERNAL, "broken")

    async def Describe(self, request, context):  # type: ignore[no-untyped-def]
        model = pb.ModelInfo(name="breaks", max_context=1000)
        return pb.DescribeResponse(models=[model], capacity=64, multiplex=True)


def test_a_broken_call_counts_once_against_its_worker(serve_raw, gateway_with):
    port = serve_raw(BreakingWorker(8))
    address = f"127.0.0.1:{port}"
    gw = gateway_with(
        models=(ModelConfig("breaks", workers=(address,)),),
        retry_attempts=1,
        eject_after_failures=3,
    )
    worker = gw.state.fleet.models["breaks"].workers[address]
    body = {"model": "breaks", "prompt": "x"}
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda _: httpx.post(f"{gw.url}/v1/completions", json=body, timeout=HANG_GUARD),
                range(8),
            )
        )
    assert all(a.status_code >= 500 for a in answers)
    wait_until(lambda: worker.outstanding == 0, "the worker's calls to end")
    # 8 requests on one broken call: one failure, not 8 (3 ejected the worker)
    assert worker.ejections_total == 0
    assert worker.consecutive_failures <= 2
