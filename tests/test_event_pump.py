"""The event pump against a fake worker stream, on a virtual clock: keep-alive
ticks and idle timeouts keep their timing when events come faster than the tick
(the pump keeps one timer across waits instead of one per wait), and a closed
pump leaves no reference cycle behind."""

import asyncio
import gc
import weakref

import pytest
import uvloop

from gateway.admission.pump import EventPump
from gateway.protocol import errors
from gateway.protocol.types import Event, Started, Text
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
