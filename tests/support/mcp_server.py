"""A real MCP server for the specs of the Responses API's remote MCP tools: the `mcp`
SDK's server over Streamable HTTP, in a process of its own on a loopback port
(`start_mcp_server`). Its tools: `lookup(key)` answers "value of <key>", `fail()` is a
tool error, `pause(seconds)` sleeps first. A URL with `?auth=1` wants the bearer token
`sesame` (else 401), so a spec sees the request's `authorization` reach the server;
`stall()` answers after ten minutes.

Run: `python -m tests.support.mcp_server PORT`.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.processes import free_port
from tests.support.waiting import HANG_GUARD

ROOT = Path(__file__).resolve().parent.parent.parent
TOKEN = "sesame"


def _app() -> object:
    from mcp.server.mcpserver import MCPServer
    from starlette.types import Receive, Scope, Send

    server = MCPServer("furnace-spec-tools")

    @server.tool()
    def lookup(key: str) -> str:
        """Looks a key up in the spec's table."""
        return f"value of {key!r}"

    @server.tool()
    def fail() -> str:
        """Always fails."""
        raise ValueError("the tool failed on purpose")

    @server.tool()
    async def pause(seconds: float) -> str:
        """Sleeps, then answers."""
        await asyncio.sleep(seconds)
        return "done"

    @server.tool()
    async def stall() -> str:
        """Answers after ten minutes: a call a client leaves, or a timeout cuts."""
        await asyncio.sleep(600)
        return "late"

    app = server.streamable_http_app()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and b"auth=1" in scope.get("query_string", b""):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != f"Bearer {TOKEN}".encode():
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await app(scope, receive, send)

    return guarded, app


@contextmanager
def start_mcp_server() -> Iterator[str]:
    """The server running in a process of its own; yields its URL (`.../mcp`)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.mcp_server", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + HANG_GUARD
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > end:
                    raise RuntimeError("the MCP server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(10)


if __name__ == "__main__":
    import uvicorn

    guarded, app = _app()
    # the SDK's app runs its session manager in its lifespan: the guard passes it on
    uvicorn.run(guarded, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")  # type: ignore[arg-type]
