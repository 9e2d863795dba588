"""A progress line on stderr while a run goes, in plain text: redrawn in place on
a terminal, one line every few seconds otherwise (CI logs, pipes)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

from gateway.bench.client import Tally

BAR_WIDTH = 30


class Progress:
    """Draws `tally` against `total` requests until stopped."""

    def __init__(self, tally: Tally, total: int, stream: TextIO = sys.stderr) -> None:
        self.tally = tally
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = 0.25 if self.tty else 5.0
        self._started = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def line(self) -> str:
        """The progress as one line."""
        tally, total = self.tally, max(self.total, 1)
        elapsed = time.perf_counter() - self._started
        filled = BAR_WIDTH * tally.done // total
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        rate = tally.chunks / elapsed if elapsed > 0 else 0.0
        return (
            f"[{bar}] {tally.done}/{self.total} requests, {tally.failed} failed, "
            f"{rate:,.0f} chunks/s, {elapsed:.1f} s"
        )

    def _draw(self, final: bool = False) -> None:
        end = "\n" if final or not self.tty else ""
        prefix = "\r\x1b[2K" if self.tty else ""
        self.stream.write(prefix + self.line() + end)
        self.stream.flush()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._draw()

    def start(self) -> None:
        """Starts drawing."""
        self._started = time.perf_counter()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        """Stops, with a last line."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._draw(final=True)
