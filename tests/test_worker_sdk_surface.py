"""The worker SDK's side of the grown protocol (issue 13), over real gRPC with a
raw grpc.aio client: every new field reaches the engine intact, a feature the
engine does not list is refused by name before it runs, n choices fan out and
merge, stop strings and logprobs per choice, tool-call deltas, Embed, Describe's
features, the demo engine's deterministic rules, and the gateway's client of
the protocol (`FurnaceGrpcUpstream`) reading all of it back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import jsonschema
import pytest

from gateway.protocol import errors, features
from gateway.protocol.convert import event_from_proto, request_to_proto
from gateway.protocol.types import (
    ContentPart,
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    Reasoning,
    ReasoningParams,
    ResponseFormat,
    SamplingParams,
    Started,
    Text,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.worker import Engine, WorkerServer
from gateway.worker.demo import DEMO_MODEL, DemoEngine, demo_vector
from tests.support.servers import ServerLoop
from tests.support.waiting import wait_until

ALL_FEATURES = features.ALL


class RecordingEngine(Engine):
    """Lists every feature, records each request it gets, answers "ok"."""

    model = "recorder"
    max_context = 100

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []
        self.embeds: list[EmbedRequest] = []

    features = ALL_FEATURES

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        yield Started(1)
        yield Text("ok", 1)
        yield Finished(FinishReason.STOP, 1)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        self.embeds.append(request)
        return Embeddings(tuple((1.0, 0.0) for _ in request.inputs), len(request.inputs))


class FirstVersionEngine(Engine):
    """An engine written before the protocol grew: lists nothing new."""

    model = "first"
    max_context = 100

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.calls += 1
        yield Started(1)
        yield Text("old", 1)
        yield Finished(FinishReason.STOP, 1)


class ChoicesEngine(Engine):
    """Answers each choice (told apart by its seed) with a scripted list of
    events; a `Exception` in the script is raised there. Counts running ones."""

    model = "choices"
    max_context = 100

    def __init__(self, scripts: dict[int, list], native_n: bool = False) -> None:
        self.scripts = scripts
        self.native_n = native_n
        self.features = features.FIRST_VERSION | {features.N, features.LOGPROBS}
        self.seeds: list[int | None] = []
        self.running = 0
        self.closed = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        seed = request.sampling.seed
        self.seeds.append(seed)
        self.running += 1
        try:
            for event in self.scripts[seed or 0]:
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, float):
                    await asyncio.sleep(event)
                    continue
                yield event
        finally:
            self.running -= 1
            self.closed += 1


# -- helpers -------------------------------------------------------------------


async def call(
    address: str, message: pb.GenerateRequest
) -> tuple[list, grpc.aio.AioRpcError | None]:
    """All events of one Generate call, and the error that ended it, if any."""
    async with grpc.aio.insecure_channel(address) as channel:
        events = []
        try:
            async for event in pb_grpc.EngineStub(channel).Generate(message, timeout=30):
                events.append(event)
        except grpc.aio.AioRpcError as error:
            return events, error
        return events, None


def ours(events: list) -> list[Event]:
    return [event_from_proto(e, details=True) for e in events]


def choice_text(events: list[Event], index: int) -> str:
    return "".join(e.text for e in events if isinstance(e, Text) and e.index == index)


@pytest.fixture
def serve(
    server_loop: ServerLoop, serve_engines: Callable[..., list[WorkerServer]]
) -> Iterator[Callable[[Engine], WorkerServer]]:
    """Serves one engine; after the test, its worker and engine are idle (leak check)."""
    served: list[WorkerServer] = []

    def start(engine: Engine) -> WorkerServer:
        (worker,) = serve_engines(engine)
        served.append(worker)
        return worker

    yield start
    for worker in served:
        wait_until(lambda w=worker: w.service.active == 0, "the worker to be idle")
        wait_until(lambda w=worker: getattr(w.engine, "running", 0) == 0, "every generation to end")


def run(
    server_loop: ServerLoop, worker: WorkerServer, **fields
) -> tuple[list[Event], grpc.aio.AioRpcError | None]:
    fields.setdefault("model", worker.engine.model)
    request = request_to_proto(GenerateRequest(**fields))
    events, error = server_loop.call(call(worker.address, request))
    return ours(events), error


# -- every field reaches the engine ----------------------------------------------------


FULL = GenerateRequest(
    model="recorder",
    messages=(
        Message("system", "be brief", name="rules"),
        Message(
            "user",
            "look",
            images=("https://example.com/a.png", "data:image/png;base64,AAAA"),
            parts=(  # the client's order, and each image's detail
                ContentPart("text", "lo"),
                ContentPart("image_url", url="https://example.com/a.png", detail="high"),
                ContentPart("text", "ok"),
                ContentPart("image_url", url="data:image/png;base64,AAAA"),
            ),
        ),
        Message(
            "assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)
        ),
        Message("tool", "sunny", tool_call_id="call_1", name="get_weather"),
    ),
    sampling=SamplingParams(
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        presence_penalty=0.25,
        frequency_penalty=-0.5,
        seed=7,
        max_tokens=9,
        min_tokens=2,
        ignore_eos=True,
        repetition_penalty=1.25,
        min_p=0.125,
        logit_bias=((3, -100.0), (50, 2.5)),
        stop_token_ids=(2, 9),
    ),
    stop=("END",),
    request_id="req-1",
    logprobs=5,
    tools=(Tool("get_weather", "the weather", '{"type":"object"}', True),),
    tool_choice="required",
    parallel_tool_calls=False,
    response_format=ResponseFormat("json_schema", '{"type":"object"}', "answer", True),
    user="user-42",
    reasoning=ReasoningParams("high", False, '{"enable_thinking":true}', 64, True),
)


def test_every_field_reaches_the_engine(server_loop, serve):
    engine = RecordingEngine()
    worker = serve(engine)
    events, error = run(
        server_loop, worker, **{f: getattr(FULL, f) for f in FULL.__dataclass_fields__}
    )
    assert error is None
    assert engine.requests == [FULL]  # n=1: the request as sent
    assert events == [Started(1), Text("ok", 1), Finished(FinishReason.STOP, 1)]


def test_a_first_version_request_is_served_as_before(server_loop, serve):
    first = pb.GenerateRequest(request_id="r", model=DEMO_MODEL, text="a b c", stop=["zz"])
    first.sampling.max_tokens = 10
    plain = GenerateRequest(
        model=DEMO_MODEL,
        prompt="a b c",
        stop=("zz",),
        request_id="r",
        sampling=SamplingParams(max_tokens=10),
    )
    # our converter writes a plain request byte for byte as the first version did
    assert request_to_proto(plain).SerializeToString() == first.SerializeToString()
    worker = serve(DemoEngine())
    events, error = server_loop.call(call(worker.address, first))
    assert error is None
    assert events[0] == pb.GenerateEvent(started=pb.Started(prompt_tokens=3))
    texts = [e.text for e in events[1:-1]]
    assert "".join(t.text for t in texts) == "a b c"
    assert sum(t.tokens for t in texts) == 3
    # nothing of the new fields on the wire: a first-version gateway reads it all
    assert all(t == pb.Text(text=t.text, tokens=t.tokens) for t in texts)
    assert events[-1] == pb.GenerateEvent(
        finished=pb.Finished(reason=pb.FINISH_REASON_STOP, completion_tokens=3)
    )


# -- features the engine does not list ---------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"sampling": SamplingParams(repetition_penalty=1.1)}, "repetition_penalty"),
        ({"sampling": SamplingParams(min_p=0.1)}, "min_p"),
        ({"sampling": SamplingParams(logit_bias=((1, 1.0),))}, "logit_bias"),
        ({"sampling": SamplingParams(stop_token_ids=(3,))}, "stop_token_ids"),
        (
            {
                "prompt": None,
                "messages": (
                    Message("user", "hi"),
                    Message("user", "x", images=("https://e/x.png",)),
                ),
            },
            "messages[1].content",
        ),
    ],
)
def test_the_demo_refuses_what_it_does_not_list(server_loop, serve, fields, param):
    engine = DemoEngine()
    worker = serve(engine)
    fields.setdefault("prompt", "hello")
    events, error = run(server_loop, worker, **fields)
    assert events == []
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("furnace-param", param) in tuple(error.trailing_metadata())
    assert engine.calls == 0  # the engine never saw it


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 0}, "logprobs"),
        ({"tools": (Tool("f"),)}, "tools"),
        ({"tool_choice": "none"}, "tools"),
        ({"response_format": ResponseFormat("json_object")}, "response_format"),
        ({"user": "u"}, "user"),
        ({"sampling": SamplingParams(min_tokens=1)}, "min_tokens"),
        ({"sampling": SamplingParams(ignore_eos=True)}, "ignore_eos"),
    ],
)
def test_a_first_version_engine_refuses_every_new_field(server_loop, serve, fields, param):
    engine = FirstVersionEngine()
    worker = serve(engine)
    _, error = run(server_loop, worker, prompt="x", **fields)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("furnace-param", param) in tuple(error.trailing_metadata())
    assert engine.calls == 0


def test_bounds_on_n_and_logprobs(server_loop, serve):
    worker = serve(RecordingEngine())
    for fields, param in (({"n": 129}, "n"), ({"logprobs": 21}, "logprobs")):
        _, error = run(server_loop, worker, prompt="x", **fields)
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("furnace-param", param) in tuple(error.trailing_metadata())
    assert worker.engine.requests == []


# -- n choices ------------------------------------------------------------------------


def test_n_choices_fan_out_and_merge(server_loop, serve):
    engine = DemoEngine()
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="one two three", n=3)
    assert error is None
    assert events[0] == Started(3)
    assert [e for e in events if isinstance(e, Started)] == [Started(3)]
    finished = [e for e in events if isinstance(e, Finished)]
    assert sorted(f.index for f in finished) == [0, 1, 2]
    assert all(f == Finished(FinishReason.STOP, 3, None, f.index) for f in finished)
    assert [choice_text(events, i) for i in range(3)] == ["one two three"] * 3
    assert engine.calls == 3 and engine.finished == 3


def test_each_choice_gets_its_own_seed(server_loop, serve):
    answer = [Started(2), Text("x", 1), Finished(FinishReason.STOP, 1)]
    engine = ChoicesEngine({10: answer, 11: answer, 12: answer})
    worker = serve(engine)
    _, error = run(server_loop, worker, prompt="p", n=3, sampling=SamplingParams(seed=10))
    assert error is None
    assert sorted(engine.seeds) == [10, 11, 12]
    engine.seeds.clear()
    engine.scripts[0] = answer
    run(server_loop, worker, prompt="p", n=2)
    assert engine.seeds == [None, None]


def test_stop_strings_are_per_choice(server_loop, serve):
    engine = ChoicesEngine(
        {
            1: [
                Started(1),
                Text("a b", 2),
                Text(" STOP c", 2),
                0.05,
                Text(" d", 1),
                Finished(FinishReason.STOP, 5),
            ],
            2: [Started(1), Text("x ST", 2), Text("OP y", 2), Finished(FinishReason.STOP, 4)],
            3: [Started(1), Text("no stop here", 3), Finished(FinishReason.LENGTH, 3)],
        }
    )
    worker = serve(engine)
    events, error = run(
        server_loop, worker, prompt="p", n=3, stop=("STOP",), sampling=SamplingParams(seed=1)
    )
    assert error is None
    assert [choice_text(events, i) for i in range(3)] == ["a b ", "x ", "no stop here"]
    finished = {e.index: e for e in events if isinstance(e, Finished)}
    # the engine ran on: stopped by the stop string, which each Finished names
    assert finished[0] == Finished(FinishReason.STOP, 4, None, 0, "STOP")
    assert finished[1] == Finished(FinishReason.STOP, 4, None, 1, "STOP")
    assert finished[2] == Finished(FinishReason.LENGTH, 3, None, 2)
    assert engine.closed == 3


def test_reasoning_passes_in_order_beside_the_stop_strings(server_loop, serve):
    """A choice's `Reasoning` goes out in its place, re-indexed with its choice; stop
    strings match the answer's text only, and its tokens count in the choice's total."""
    script = [
        Started(1),
        Reasoning("I see STOP", 3),
        Reasoning(" here", 1),
        Text("a b", 2),
        Text(" STOP c", 2),
        Finished(FinishReason.STOP, 8),
    ]
    engine = ChoicesEngine({1: script, 2: script})
    worker = serve(engine)
    events, error = run(
        server_loop, worker, prompt="p", n=2, stop=("STOP",), sampling=SamplingParams(seed=1)
    )
    assert error is None
    for i in range(2):
        mine = [e for e in events if not isinstance(e, Started) and e.index == i]
        assert mine == [
            Reasoning("I see STOP", 3, i),
            Reasoning(" here", 1, i),
            Text("a b ", 4, i),
            Finished(FinishReason.STOP, 8, None, i, "STOP"),
        ]


def test_the_demo_thinks_by_the_effort(server_loop, serve):
    worker = serve(DemoEngine())
    for effort, thought in (
        ("low", ["d"]),
        ("medium", ["c", " d"]),
        ("high", ["a", " b", " c", " d"]),
    ):
        events, error = run(
            server_loop, worker, prompt="a b c d", reasoning=ReasoningParams(effort=effort)
        )
        assert error is None
        assert [e.text for e in events if isinstance(e, Reasoning)] == thought
        assert choice_text(events, 0) == "a b c d"
        assert events[-1] == Finished(FinishReason.STOP, 4 + len(thought))
    for reasoning in (ReasoningParams(effort="none"), ReasoningParams(off=True)):
        events, error = run(server_loop, worker, prompt="a b c d", reasoning=reasoning)
        assert error is None and not any(isinstance(e, Reasoning) for e in events)
        assert events[-1] == Finished(FinishReason.STOP, 4)


def test_one_failing_choice_fails_the_call(server_loop, serve):
    engine = ChoicesEngine(
        {
            1: [Started(1)] + [Text("w ", 1), 0.01] * 1000 + [Finished(FinishReason.STOP, 1000)],
            2: [Started(1), Text("x", 1), errors.Unavailable("the GPU fell over")],
        }
    )
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="p", n=2, sampling=SamplingParams(seed=1))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert events[0] == Started(1)
    wait_until(lambda: engine.running == 0, "the other choice to stop")


def test_a_refused_choice_is_a_status_before_started(server_loop, serve):
    answer = [Started(1), Text("x", 1), Finished(FinishReason.STOP, 1)]
    engine = ChoicesEngine({1: answer, 2: [errors.TooLong("too long")]})
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="p", n=2, sampling=SamplingParams(seed=1))
    assert events == []
    assert error is not None and error.code() == grpc.StatusCode.OUT_OF_RANGE


def test_cancelling_stops_every_choice(server_loop, serve):
    engine = DemoEngine(token_delay=0.02)
    worker = serve(engine)

    async def cancel_after_two() -> None:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            request = request_to_proto(GenerateRequest(model=DEMO_MODEL, prompt="w " * 500, n=4))
            stream = pb_grpc.EngineStub(channel).Generate(request)
            await stream.read()
            await stream.read()
            stream.cancel()

    server_loop.call(cancel_after_two())
    wait_until(lambda: engine.aborted == 4, "every choice to stop")
    assert engine.running == 0 and engine.calls == 4


def test_many_choices_still_coalesce(server_loop, serve):
    worker = serve(DemoEngine(max_context=10_000))
    words = " ".join(f"w{i}" for i in range(500))
    events, error = run(server_loop, worker, prompt=words, n=2)
    assert error is None
    texts = [e for e in events if isinstance(e, Text)]
    assert [choice_text(events, i) for i in range(2)] == [words, words]
    assert sum(t.tokens for t in texts) == 1000
    assert len(texts) < 200  # far fewer messages than tokens


class EndlessEngine(Engine):
    """Each choice writes 1 KiB tokens until stopped; counts what it made."""

    model = "endless"
    max_context = 1 << 30

    def __init__(self) -> None:
        self.produced = 0
        self.running = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.running += 1
        try:
            yield Started(1)
            while True:
                self.produced += 1
                yield Text("x" * 1024, 1)
                await asyncio.sleep(0)
        finally:
            self.running -= 1


def test_a_stalled_reader_holds_back_every_choice(server_loop, serve):
    engine = EndlessEngine()
    worker = serve(engine)

    async def stall() -> int:
        # a fixed receive window, as the gateway's channels have (no BDP probing)
        options = (("grpc.http2.bdp_probe", 0),)
        async with grpc.aio.insecure_channel(worker.address, options=options) as channel:
            request = request_to_proto(GenerateRequest(model="endless", prompt="go", n=3))
            stream = pb_grpc.EngineStub(channel).Generate(request)
            await stream.read()  # Started; then read nothing more
            last = -1
            while engine.produced != last:
                last = engine.produced
                await asyncio.sleep(0.3)
            stream.cancel()
            return last

    held_back_at = server_loop.call(stall())
    # the read-ahead (64 KiB over all choices, not per choice) plus what gRPC's windows
    # and sockets hold: about 210 KiB here, as for one choice
    assert held_back_at * 1024 < 512 * 1024
    wait_until(lambda: engine.running == 0, "every choice to stop")


def test_a_native_n_engine_indexes_its_own_choices(server_loop, serve):
    script = [
        Started(2),
        Text("a", 1, 1),
        Text("b", 1, 0),
        ToolCallDelta(1, 0, "call_x", "f", ""),
        ToolCallDelta(1, 0, "", "", "{}", 1),
        Finished(FinishReason.TOOL_CALLS, 2, None, 1),
        Finished(FinishReason.STOP, 1, None, 0),
    ]
    engine = ChoicesEngine({0: script}, native_n=True)
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="p", n=2)
    assert error is None
    assert engine.seeds == [None]  # one generation for both choices
    assert events[0] == Started(2)
    assert [e for e in events if isinstance(e, ToolCallDelta)] == [script[3], script[4]]
    assert choice_text(events, 0) == "b" and choice_text(events, 1) == "a"
    assert {e.index: e.reason for e in events if isinstance(e, Finished)} == {
        0: FinishReason.STOP,
        1: FinishReason.TOOL_CALLS,
    }
    engine.scripts[0] = [Started(1), Text("a", 1, 5), Finished(FinishReason.STOP, 1, None, 5)]
    _, error = run(server_loop, worker, prompt="p", n=2)
    assert error is not None and error.code() == grpc.StatusCode.INTERNAL  # no choice 5 of 2


# -- logprobs and tool calls ---------------------------------------------------------------


def lp(token: str) -> TokenLogprob:
    return TokenLogprob(token, -0.5, ((token, -0.5), ("?", -1.5)))


def test_logprobs_pass_with_their_text(server_loop, serve):
    engine = ChoicesEngine(
        {0: [Started(1), Text("ab", 2, 0, (lp("a"), lp("b"))), Finished(FinishReason.STOP, 2)]}
    )
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="p", logprobs=1)
    assert error is None
    assert events[1] == Text("ab", 2, 0, (lp("a"), lp("b")))


def test_a_stop_string_keeps_the_logprobs_of_tokens_released(server_loop, serve):
    # tokens "x", " S", "TO", "P", " y": the stop "STOP" starts inside " S"
    script = [
        Started(1),
        Text("x", 1, 0, (lp("x"),)),
        Text(" S", 1, 0, (lp(" S"),)),
        Text("TO", 1, 0, (lp("TO"),)),
        Text("P", 1, 0, (lp("P"),)),
        Text(" y", 1, 0, (lp(" y"),)),
        Finished(FinishReason.STOP, 5),
    ]
    engine = ChoicesEngine({0: script})
    worker = serve(engine)
    events, error = run(server_loop, worker, prompt="p", logprobs=1, stop=("STOP",))
    assert error is None
    texts = [e for e in events if isinstance(e, Text)]
    assert "".join(t.text for t in texts) == "x "
    # " S" is partly released: kept; "TO" and "P" lie inside the stop string: dropped
    assert [entry.token for t in texts for entry in t.logprobs or ()] == ["x", " S"]
    assert events[-1] == Finished(FinishReason.STOP, 4, stop_sequence="STOP")


def test_held_text_releases_its_logprobs_at_the_end(server_loop, serve):
    script = [Started(1), Text("a S", 2, 0, (lp("a"), lp(" S"))), Finished(FinishReason.LENGTH, 2)]
    worker = serve(ChoicesEngine({0: script}))
    events, _ = run(server_loop, worker, prompt="p", logprobs=1, stop=("STOP",))
    texts = [e for e in events if isinstance(e, Text)]
    assert "".join(t.text for t in texts) == "a S"
    assert [entry.token for t in texts for entry in t.logprobs or ()] == ["a", " S"]


def test_tool_call_deltas_pass_in_order(server_loop, serve):
    script = [
        Started(1),
        Text("Let me ", 2),
        Text("check.", 1),
        ToolCallDelta(0, 0, "call_a", "get_weather", ""),
        ToolCallDelta(0, 0, "", "", '{"city"', 1),
        ToolCallDelta(0, 0, "", "", ':"Oslo"}', 1),
        ToolCallDelta(0, 1, "call_b", "get_time", ""),
        ToolCallDelta(0, 1, "", "", "{}", 1),
        Finished(FinishReason.TOOL_CALLS, 6),
    ]
    worker = serve(ChoicesEngine({0: script}))
    events, error = run(server_loop, worker, prompt="p", stop=("STOP",))
    assert error is None
    assert choice_text(events, 0) == "Let me check."
    assert [e for e in events if isinstance(e, ToolCallDelta)] == script[3:8]
    assert events[-1] == Finished(FinishReason.TOOL_CALLS, 6)


# -- the demo's rules ----------------------------------------------------------------------------

WEATHER = Tool(
    "get_weather",
    "the weather",
    json.dumps(
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["c", "f"]},
                "hourly": {"type": "boolean"},
                "spots": {"type": "array", "items": {"type": "string"}},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}},
                    "required": ["lat"],
                },
                "note": {"type": "string"},
            },
            "required": ["city", "days", "unit", "hourly", "spots", "where"],
        }
    ),
)
TIME = Tool("get_time")


def calls(events: list[Event]) -> list[tuple[str, str]]:
    """(name, arguments) of each call in the events."""
    out: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id:
                assert e.id.startswith("call_") and len(e.id) == 29
                assert e.arguments == "" and e.tokens == 0
                out[e.call_index] = [e.name, ""]
            else:
                assert 1 <= len(e.arguments) <= 8 and e.tokens == 1
                out[e.call_index][1] += e.arguments
    return [(name, args) for name, args in (out[i] for i in sorted(out))]


MINIMAL = '{"city":"","days":0,"unit":"c","hourly":false,"spots":[],"where":{"lat":0}}'


@pytest.mark.parametrize(
    ("last", "choice", "parallel", "expected"),
    [
        ("hello", "required", None, [("get_weather", MINIMAL)]),
        ("hello", "get_time", None, [("get_time", "{}")]),
        (
            "get_time and get_weather please",
            "auto",
            None,
            [("get_weather", MINIMAL), ("get_time", "{}")],
        ),
        ("get_time and get_weather please", "", False, [("get_weather", MINIMAL)]),
        ("what is the time?", "auto", None, []),
        ("get_time", "none", None, []),
    ],
)
def test_demo_tool_calls(server_loop, serve, last, choice, parallel, expected):
    worker = serve(DemoEngine())
    events, error = run(
        server_loop,
        worker,
        messages=(Message("user", last),),
        tools=(WEATHER, TIME),
        tool_choice=choice,
        parallel_tool_calls=parallel,
    )
    assert error is None
    assert calls(events) == expected
    finished = events[-1]
    assert isinstance(finished, Finished)
    if expected:
        assert finished.reason == FinishReason.TOOL_CALLS
        assert choice_text(events, 0) == ""
        assert finished.completion_tokens == sum(-(-len(a) // 8) for _, a in expected)
    else:
        assert finished.reason == FinishReason.STOP
        assert choice_text(events, 0) == last


def test_demo_refuses_a_tool_choice_it_does_not_have(server_loop, serve):
    engine = DemoEngine()
    worker = serve(engine)
    _, error = run(server_loop, worker, prompt="x", tools=(TIME,), tool_choice="get_nothing")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("furnace-param", "tool_choice") in tuple(error.trailing_metadata())
    assert engine.refused == 1 and engine.running == 0


def test_demo_structured_answers(server_loop, serve):
    worker = serve(DemoEngine())
    events, _ = run(
        server_loop, worker, prompt="x y", response_format=ResponseFormat("json_object")
    )
    assert choice_text(events, 0) == "{}"
    schema = json.loads(WEATHER.parameters)
    events, _ = run(
        server_loop,
        worker,
        prompt="x y",
        response_format=ResponseFormat("json_schema", WEATHER.parameters, "weather", True),
    )
    text = choice_text(events, 0)
    assert text == MINIMAL
    jsonschema.validate(json.loads(text), schema)
    assert events[-1] == Finished(FinishReason.STOP, -(-len(MINIMAL) // 8))  # 8 characters a token


def test_demo_min_tokens_and_ignore_eos(server_loop, serve):
    worker = serve(DemoEngine())
    events, _ = run(server_loop, worker, prompt="a b", sampling=SamplingParams(min_tokens=5))
    assert choice_text(events, 0) == "a b a b a"
    assert events[-1] == Finished(FinishReason.STOP, 5)
    events, _ = run(
        server_loop, worker, prompt="a b", sampling=SamplingParams(ignore_eos=True, max_tokens=3)
    )
    assert choice_text(events, 0) == "a b a"
    assert events[-1] == Finished(FinishReason.LENGTH, 3)
    _, error = run(server_loop, worker, prompt="a b", sampling=SamplingParams(ignore_eos=True))
    assert ("furnace-param", "ignore_eos") in tuple(error.trailing_metadata())


@pytest.mark.parametrize("top", [0, 1, 3])
def test_demo_logprobs(server_loop, serve, top):
    worker = serve(DemoEngine())
    events, _ = run(server_loop, worker, prompt="a b", logprobs=top)
    entries = [entry for e in events if isinstance(e, Text) for entry in e.logprobs or ()]
    assert [entry.token for entry in entries] == ["a", " b"]
    for entry in entries:
        assert entry.logprob == -1.0
        expected = [(entry.token, -1.0)] + [(f"<alt{i}>", -1.0 - i) for i in range(1, top)]
        expected = expected[:top]  # exactly `logprobs` entries
        assert list(entry.top) == expected


def test_demo_user_is_taken(server_loop, serve):
    worker = serve(DemoEngine())
    events, error = run(server_loop, worker, prompt="a", user="someone")
    assert error is None and choice_text(events, 0) == "a"


# -- Embed ---------------------------------------------------------------------------------


async def embed(address: str, **fields) -> pb.EmbedResponse | grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            return await pb_grpc.EngineStub(channel).Embed(pb.EmbedRequest(**fields), timeout=10)
        except grpc.aio.AioRpcError as error:
            return error


def test_demo_embeddings(server_loop, serve):
    worker = serve(DemoEngine())
    inputs = [pb.EmbedInput(text="hello there"), pb.EmbedInput(tokens=pb.TokenIds(ids=[1, 2, 3]))]
    reply = server_loop.call(embed(worker.address, model=DEMO_MODEL, inputs=inputs))
    assert reply.prompt_tokens == 5
    vectors = [tuple(e.values) for e in reply.embeddings]
    assert len(vectors) == 2 and all(len(v) == 32 for v in vectors)
    assert vectors[0] == pytest.approx(demo_vector("hello there"))
    assert vectors[1] == pytest.approx(demo_vector("1 2 3"))
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, rel=1e-5)
    short = server_loop.call(embed(worker.address, inputs=inputs[:1], dimensions=4, user="u"))
    assert tuple(short.embeddings[0].values) == pytest.approx(demo_vector("hello there", 4))
    assert sum(x * x for x in short.embeddings[0].values) == pytest.approx(1.0, rel=1e-5)


def test_embed_refusals(server_loop, serve):
    demo = serve(DemoEngine())
    first = serve(FirstVersionEngine())
    text = [pb.EmbedInput(text="x")]
    cases = [
        (demo, {"model": "other", "inputs": text}, grpc.StatusCode.NOT_FOUND, None),
        (first, {"inputs": text}, grpc.StatusCode.INVALID_ARGUMENT, "model"),
        (demo, {"inputs": text, "dimensions": 33}, grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
        (demo, {"inputs": []}, grpc.StatusCode.INVALID_ARGUMENT, "input"),
    ]
    for worker, fields, code, param in cases:
        error = server_loop.call(embed(worker.address, **fields))
        assert isinstance(error, grpc.aio.AioRpcError), fields
        assert error.code() == code
        if param:
            assert ("furnace-param", param) in tuple(error.trailing_metadata())


def test_embed_refuses_unlisted_options(server_loop, serve):
    class Plain(RecordingEngine):
        features = frozenset({features.EMBEDDINGS})

    engine = Plain()
    worker = serve(engine)
    for fields, param in (({"dimensions": 8}, "dimensions"), ({"user": "u"}, "user")):
        error = server_loop.call(embed(worker.address, inputs=[pb.EmbedInput(text="x")], **fields))
        assert ("furnace-param", param) in tuple(error.trailing_metadata())
    assert engine.embeds == []
    _, error = run(server_loop, worker, prompt="x")  # an embedding model does not generate
    assert ("furnace-param", "model") in tuple(error.trailing_metadata())


def test_an_engine_that_embeds_wrongly_fails(server_loop, serve):
    class Short(RecordingEngine):
        async def embed(self, request: EmbedRequest) -> Embeddings:
            return Embeddings(((1.0,),), 1)

    worker = serve(Short())
    error = server_loop.call(embed(worker.address, inputs=[pb.EmbedInput(text="x")] * 2))
    assert error.code() == grpc.StatusCode.INTERNAL


# -- Describe, and the gateway's client of the protocol ----------------------------------------


def test_describe_lists_features(server_loop, serve):
    demo, first, recorder = (
        serve(DemoEngine()),
        serve(FirstVersionEngine()),
        serve(RecordingEngine()),
    )

    async def describe(address: str) -> list:
        upstream = FurnaceGrpcUpstream(address)
        try:
            return await upstream.describe(5)
        finally:
            await upstream.close()

    (model,) = server_loop.call(describe(demo.address))
    assert model.features == DemoEngine.features | {features.INCLUDE_STOP}  # "n" among them
    assert features.IMAGES not in model.features and features.MIN_P not in model.features
    (model,) = server_loop.call(describe(first.address))
    # the SDK adds n and the stop strings' keeping
    assert model.features == {features.GENERATE, features.N, features.INCLUDE_STOP}
    (model,) = server_loop.call(describe(recorder.address))
    # but sounds and videos: the protocol has no field for one, whatever a worker lists
    assert model.features == features.ALL - features.NOT_CARRIED


def test_a_first_version_worker_describes_as_one(server_loop, workers):
    async def describe() -> list:
        upstream = FurnaceGrpcUpstream(workers.scripted.address)
        try:
            return await upstream.describe(5)
        finally:
            await upstream.close()

    (model,) = server_loop.call(describe())
    assert model.features == features.FIRST_VERSION


def test_the_upstream_reads_everything_back(server_loop, serve):
    engine = RecordingEngine()
    recorder = serve(engine)
    demo = serve(DemoEngine())

    async def through_upstream() -> tuple:
        upstream = FurnaceGrpcUpstream(demo.address)
        rec = FurnaceGrpcUpstream(recorder.address)
        try:
            request = GenerateRequest(
                model=DEMO_MODEL,
                messages=(Message("user", "get_time now"),),
                tools=(TIME,),
                n=2,
                logprobs=2,
            )
            events = [e async for e in upstream.call(request, timeout=10)]
            vectors = await upstream.embed(
                EmbedRequest(DEMO_MODEL, ("a b", (4, 5)), dimensions=8), timeout=10
            )
            try:
                await upstream.embed(EmbedRequest(DEMO_MODEL, ("x",), dimensions=99), timeout=10)
            except errors.Invalid as error:
                refusal = error
            await rec.embed(
                EmbedRequest("recorder", ("x",), user="u", request_id="e1"),
                timeout=10,
                metadata=(("x-request-id", "e1"),),
            )
            return events, vectors, refusal
        finally:
            await upstream.close()
            await rec.close()

    events, vectors, refusal = server_loop.call(through_upstream())
    assert events[0] == Started(2)
    assert [calls([e for e in events if getattr(e, "index", 0) == i]) for i in range(2)] == [
        [("get_time", "{}")],
        [("get_time", "{}")],
    ]
    assert {e.index for e in events if isinstance(e, Finished)} == {0, 1}
    assert vectors.prompt_tokens == 4
    assert vectors.vectors[0] == pytest.approx(demo_vector("a b", 8))
    assert vectors.vectors[1] == pytest.approx(demo_vector("4 5", 8))
    assert refusal.param == "dimensions"
    assert engine.embeds == [EmbedRequest("recorder", ("x",), user="u", request_id="e1")]


class ShortEmbedder(pb_grpc.EngineServicer):
    """A raw worker (not our SDK, which would refuse to send it) whose Embed
    answers one vector whatever it is asked."""

    async def Embed(self, request: pb.EmbedRequest, context: object) -> pb.EmbedResponse:
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=[1.0])], prompt_tokens=1)


def test_the_upstream_refuses_an_answer_of_another_length(server_loop):
    async def ask() -> tuple[errors.GatewayError | None, Embeddings]:
        server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
        pb_grpc.add_EngineServicer_to_server(ShortEmbedder(), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        upstream = FurnaceGrpcUpstream(address)
        try:
            one = await upstream.embed(EmbedRequest("m", ("x",)), timeout=10)
            try:
                await upstream.embed(EmbedRequest("m", ("x", "y")), timeout=10)
            except errors.GatewayError as error:
                return error, one
            return None, one
        finally:
            await upstream.close()
            await server.stop(0)

    error, one = server_loop.call(ask())
    assert one == Embeddings(((1.0,),), 1)
    assert isinstance(error, errors.Failed)
