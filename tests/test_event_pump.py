"""The event pump against a fake worker stream, on a virtual clock: keep-alive
ticks and idle timeouts keep their timing when events come faster than the tick
(the pump keeps one timer across waits instead of one per wait), and a closed
pump leaves no reference cycle behind. The start runs in the edge's task: a
cancel or the idle timeout ends its wait without leaving that task cancelled; a
stream that pushes is read without a task, within the buffer's bound; among other
streams a stream writes in the next write turn (a few streams in each turn of the
loop), alone at once."""

import asyncio
import gc
import itertools
import weakref
from collections.abc import Callable

import pytest
import uvloop

from gateway.admission.pump import EventPump
from gateway.admission.turns import PACE, TURN_STREAMS, write_turns
from gateway.protocol import errors
from gateway.protocol.types import Event, Finished, FinishReason, Started, Text
from tests.support.virtual_time import run_virtual


class FakeStream:
    """A worker stream whose events the test puts in a queue."""

    worker = "fake"

    def __init__(self) -> None:
        self.events: asyncio.Queue[Event] = asyncio.Queue()

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> Event:
        return await self.events.get()

    def cancel(self, outcome: object = None) -> None:
        pass

    def close(self, outcome: object = None) -> None:
        pass


def pump_over(stream: FakeStream) -> EventPump:
    async def start() -> tuple[Started, FakeStream]:
        return Started(1), stream

    return EventPump(start())


def test_no_early_tick_while_events_come_and_one_after_they_stop():
    tick = 0.25  # binary fractions: the virtual clock's sums stay exact

    async def main() -> tuple[list[int], float]:
        loop = asyncio.get_running_loop()
        stream = FakeStream()
        pump = pump_over(stream)

        async def produce() -> None:  # for two ticks, an event every eighth of one
            for i in range(16):
                await asyncio.sleep(tick / 8)
                stream.events.put_nowait(Text(str(i), 1))

        producer = asyncio.create_task(produce())
        sizes = []
        try:
            assert await pump.next_batch(5.0) == [Started(1)]
            while sum(sizes) < 16:
                sizes.append(len(await pump.next_batch(5.0, tick)))
            began = loop.time()
            assert await pump.next_batch(5.0, tick) == []  # quiet now: the tick
            return sizes, loop.time() - began
        finally:
            await producer
            await pump.aclose()

    sizes, waited = run_virtual(main())
    assert 0 not in sizes  # the timer set for an early wait woke none of the later ones
    assert waited == tick  # one tick after the last event, not sooner nor later


def test_the_idle_timeout_still_ends_a_stream_that_ticks():
    async def main() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        stream = FakeStream()
        pump = pump_over(stream)
        ticks = 0
        try:
            await pump.next_batch(5.0)
            stream.events.put_nowait(Text("a", 1))
            await pump.next_batch(0.5, 0.125)
            last_event = loop.time()
            with pytest.raises(errors.Timeout):
                while True:
                    assert await pump.next_batch(0.5, 0.125) == []
                    ticks += 1
            return ticks, loop.time() - last_event
        finally:
            await pump.aclose()

    ticks, idle = run_virtual(main())
    assert (ticks, idle) == (3, 0.5)  # ticks at 1/8, 2/8 and 3/8 s; the timeout at 4/8


def test_a_cancelled_pump_is_freed_without_the_cycle_collector():
    # the error it raised holds its frames: kept, it would make a cycle
    async def main() -> weakref.ref:
        pump = pump_over(FakeStream())
        await pump.next_batch(5.0)

        async def edge() -> None:  # waits as the route does, in its own frame
            with pytest.raises(errors.Unavailable):
                await pump.next_batch(5.0, 1.0)
            await pump.aclose()

        waiting = asyncio.ensure_future(edge())
        await asyncio.sleep(0)
        pump.cancel()  # the client went away
        await waiting
        return weakref.ref(pump)

    gc.disable()
    try:
        assert uvloop.run(main())() is None
    finally:
        gc.enable()


class ReadyStream(FakeStream):
    """A stream whose events are all ready at once, as SSE events parsed from one
    large read are: reading them never waits. Each read is logged by name."""

    def __init__(self, name: str, count: int, log: list[str]) -> None:
        super().__init__()
        self.name, self.left, self.log = name, count, log

    async def __anext__(self) -> Event:
        if not self.left:
            await asyncio.Event().wait()  # no more: wait until cancelled
        self.left -= 1
        self.log.append(self.name)
        return Text("x", 1)


def _runs(log: list[str]) -> list[int]:
    """Lengths of the runs of one reader's reads in a row."""
    runs = [1]
    for before, after in itertools.pairwise(log):
        if after == before:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def test_readers_with_much_ready_take_turns_and_a_lone_one_reads_on():
    async def main(names: str) -> list[str]:
        log: list[str] = []
        pumps = [pump_over(ReadyStream(name, 200, log)) for name in names]

        async def edge(pump: EventPump) -> None:  # each request's edge in its own task
            taken = 0
            while taken < 201:  # Started and 200 texts
                taken += len(await pump.next_batch(5.0))

        try:
            await asyncio.gather(*map(edge, pumps))
            return log
        finally:
            for pump in pumps:
                await pump.aclose()

    both = uvloop.run(main("ab"))
    assert both.index("b") < len(both) - 1 - both[::-1].index("a")  # b began before a ended
    assert len(_runs(both)) > 20  # turns of a few events each, not one reader then the other
    assert _runs(uvloop.run(main("a"))) == [200]  # alone, nothing to yield to
    assert EventPump.reading == 0


class PushingStream(FakeStream):
    """A stream that pushes, as the raw HTTP upstream does: the test adds events
    and tells the listener, as a network read would."""

    def __init__(self) -> None:
        super().__init__()
        self.ready: list[Event] = []
        self.listener: Callable[[], None] | None = None
        self.polls = 0

    async def __anext__(self) -> Event:
        raise AssertionError("a pushing stream is not read by a task")

    def listen(self, listener: Callable[[], None] | None) -> bool:
        self.listener = listener
        return True

    def poll(self) -> Event | None:
        self.polls += 1
        return self.ready.pop(0) if self.ready else None

    def push(self, *events: Event) -> None:
        self.ready += events
        assert self.listener is not None
        self.listener()


class BrokenStream(PushingStream):
    """A pushing stream whose reading fails in the gateway's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled_with: object = None

    def poll(self) -> Event | None:
        if self.ready:
            raise RuntimeError("a bug in reading the worker's answer")
        return None

    def cancel(self, outcome: object = None) -> None:
        self.cancelled_with = outcome


def test_a_bug_in_reading_a_call_fails_the_request_and_stops_the_call():
    async def main() -> None:
        stream = BrokenStream()

        async def start() -> tuple[Started, BrokenStream]:
            return Started(1), stream

        pump = EventPump(start())
        try:
            assert await pump.next_batch(5.0) == [Started(1)]
            stream.push(Text("a", 1))
            with pytest.raises(errors.Failed, match="gateway failed"):
                await pump.next_batch(5.0)
            assert isinstance(stream.cancelled_with, errors.Failed)  # the worker hears it
        finally:
            await pump.aclose()

    run_virtual(main())


def test_a_pushing_stream_is_read_without_a_task_and_within_the_bound():
    async def main() -> None:
        stream = PushingStream()
        stream.ready.append(Text("ab", 1))  # came with the first event

        async def start() -> tuple[Started, PushingStream]:
            return Started(1), stream

        pump = EventPump(start(), buffer_chars=2)
        try:
            assert await pump.next_batch(5.0) == [Started(1), Text("ab", 1)]
            assert EventPump.reading == 0
            stream.push(Text("cde", 1), Text("f", 1), Text("g", 1))
            assert stream.ready == [Text("f", 1), Text("g", 1)]  # past 2 characters: held
            assert await pump.next_batch(5.0) == [Text("cde", 1)]
            assert stream.ready == []  # taking the batch took the rest
            stream.push(Finished(FinishReason.STOP, 3, 1))
            assert await pump.next_batch(5.0) == [
                Text("f", 1),
                Text("g", 1),
                Finished(FinishReason.STOP, 3, 1),
            ]
            with pytest.raises(errors.Failed):
                await pump.next_batch(5.0)  # over
        finally:
            await pump.aclose()
        assert stream.listener is None  # let go: no cycle through the stream

    uvloop.run(main())


def test_cancelling_the_start_ends_the_wait_not_the_task():
    async def main() -> None:
        began = asyncio.Event()
        cancelled = []

        async def start() -> tuple[Started, FakeStream]:
            began.set()
            try:
                await asyncio.Event().wait()  # the worker never answers
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
            raise AssertionError("unreachable")

        pump = EventPump(start())
        edge = asyncio.current_task()
        assert edge is not None
        asyncio.get_running_loop().call_soon(lambda: began.is_set() and pump.cancel())
        with pytest.raises(errors.Unavailable):
            await pump.next_batch(5.0)
        assert cancelled == [True]  # the start saw it (the fleet cancels the call)
        assert edge.cancelling() == 0  # and the edge's task goes on, not cancelled
        await asyncio.sleep(0)
        await pump.aclose()

    uvloop.run(main())


def test_a_start_that_sends_nothing_ends_at_the_idle_timeout():
    async def main() -> float:
        loop = asyncio.get_running_loop()

        async def start() -> tuple[Started, FakeStream]:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        pump = EventPump(start())
        began = loop.time()
        try:
            with pytest.raises(errors.Timeout):
                await pump.next_batch(0.5)
            return loop.time() - began
        finally:
            await pump.aclose()

    assert run_virtual(main()) == 0.5


async def _waits_for_events(others: int, every: float) -> list[float]:
    """How long the edge waits for each of two events a worker sends `every` seconds
    after the edge's wait began, with `others` more streams open."""
    loop = asyncio.get_running_loop()
    open_pumps = [pump_over(FakeStream()) for _ in range(others)]
    stream = PushingStream()

    async def start() -> tuple[Started, PushingStream]:
        return Started(1), stream

    pump = EventPump(start())
    waits = []
    try:
        stream.ready.append(Text("first", 1))
        assert await pump.next_batch(5.0) == [Started(1), Text("first", 1)]  # at once
        for text in "ab":
            if every:
                loop.call_later(every, stream.push, Text(text, 1))
            else:
                loop.call_soon(stream.push, Text(text, 1))
            began = loop.time()
            assert await pump.next_batch(5.0) == [Text(text, 1)]
            waits.append(loop.time() - began)
        return waits
    finally:
        await pump.aclose()
        for other in open_pumps:
            await other.aclose()


def test_among_other_streams_a_stream_writes_in_the_next_turn_and_alone_at_once():
    assert run_virtual(_waits_for_events(others=0, every=0)) == [0.0, 0.0]
    paced = run_virtual(_waits_for_events(others=1, every=0))
    assert all(0 < wait <= PACE for wait in paced)


def test_a_stream_slower_than_the_turns_writes_each_event_at_once():
    """Behind an engine that takes longer than a turn a token, the turn would merge
    nothing: the edge writes when the event comes, among other streams or alone."""
    slow = 3 * PACE
    assert run_virtual(_waits_for_events(others=0, every=slow)) == [slow, slow]
    assert run_virtual(_waits_for_events(others=1, every=slow)) == [slow, slow]


def test_a_write_turn_lets_a_few_streams_write_in_each_turn_of_the_loop():
    async def main() -> list[int]:
        turns = write_turns(asyncio.get_running_loop())
        waiting = [turns.next() for _ in range(2 * TURN_STREAMS + 1)]
        waiting[TURN_STREAMS].cancel()  # its request ended meanwhile
        await waiting[0]  # the turn came: its first streams write
        done = []
        for _ in range(4):
            done.append(sum(w.done() and not w.cancelled() for w in waiting))
            await asyncio.sleep(0)
        return done

    # the cancelled one is skipped; the next few in the next turn of the loop, and so on
    few = TURN_STREAMS
    assert run_virtual(main()) == [few, 2 * few - 1, 2 * few, 2 * few]


def test_events_pushed_while_the_edge_waits_go_to_its_sink_and_the_tick_follows_them():
    """The edge's sink writes what is pushed while the edge waits, in the callback
    that brought it: the edge's wait goes on, its keep-alive tick a tick after the
    last event written, not after the wait began; a batch the sink refuses (an end)
    wakes the edge with it."""
    tick = 0.25

    async def main() -> tuple[list[list[Event]], float, list[Event]]:
        loop = asyncio.get_running_loop()
        stream = PushingStream()

        async def start() -> tuple[Started, PushingStream]:
            return Started(1), stream

        pump = EventPump(start())
        written: list[list[Event]] = []

        def sink(batch: list[Event]) -> bool:
            if any(type(event) is not Text for event in batch):
                return False
            written.append(batch)
            return True

        try:
            assert await pump.next_batch(5.0) == [Started(1)]
            pump.sink = sink
            for i in range(4):  # every half tick: the tick set when the wait began passes
                loop.call_later(tick / 2 * (i + 1), stream.push, Text(str(i), 1))
            began = loop.time()
            assert await pump.next_batch(5.0, tick) == []  # woken by the tick alone
            waited = loop.time() - began
            end = Finished(FinishReason.STOP, 5, 1)
            loop.call_soon(stream.push, Text("e", 1), end)
            return written, waited, await pump.next_batch(5.0, tick)
        finally:
            await pump.aclose()

    written, waited, last = run_virtual(main())
    assert written == [[Text(str(i), 1)] for i in range(4)]
    assert waited == 3 * tick  # the last event at 2 ticks, then a tick of quiet
    assert last == [Text("e", 1), Finished(FinishReason.STOP, 5, 1)]


def test_the_sink_sleeps_while_events_come_faster_than_the_turns():
    """Pushed back to back (`_hot`), events go to the edge's task, whose write turns
    merge them, not to the sink one by one."""

    async def main() -> list[Event]:
        stream = PushingStream()

        async def start() -> tuple[Started, PushingStream]:
            return Started(1), stream

        pump = EventPump(start())
        pump.sink = lambda batch: pytest.fail("a hot stream's events went to the sink")
        try:
            assert await pump.next_batch(5.0) == [Started(1)]
            asyncio.get_running_loop().call_soon(stream.push, Text("a", 1))
            return await pump.next_batch(5.0)
        finally:
            await pump.aclose()

    assert run_virtual(main()) == [Text("a", 1)]
