"""A worker as a process: serve one engine until SIGTERM or SIGINT.

It sits in the worker SDK, not in the gateway's lifecycle, so that the `worker`
command runs in an engine's own environment (vLLM's, say) with nothing of the
gateway's server installed: it imports the SDK and the protocol only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Coroutine
from typing import Any

from gateway.protocol.tls import ServerTLS
from gateway.worker.engine import Engine
from gateway.worker.server import WorkerServer

SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve_worker(
    engine: Engine,
    host: str,
    port: int,
    tls: ServerTLS | None = None,
    drain_timeout: float = 5.0,
) -> None:
    """A worker until SIGTERM or SIGINT; then calls in flight get `drain_timeout`
    seconds (`worker --drain-timeout`; the chart's from a pool's grace period) while
    new ones are refused. A signal while the engine starts stops the start."""
    worker = WorkerServer(engine, host, port, tls)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    starting = loop.create_task(worker.start())
    stopping = loop.create_task(stop.wait())
    try:
        await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # raises why the engine did not start
            # The engine (a model, a runtime) lives as long as the process: out of the
            # cyclic collector's reach, a full collection no longer walks it, a pause of
            # every request on the worker (as the gateway's serve does).
            gc.freeze()
            await stopping
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
    finally:
        stopping.cancel()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        await worker.stop(drain_timeout)


def run_worker(main: Coroutine[Any, Any, None]) -> None:
    """Runs `main` on uvloop when installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:  # an engine's environment need not have it
        asyncio.run(main)
        return
    uvloop.run(main)
