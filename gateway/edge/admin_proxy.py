"""The admin listener of a gateway of several processes (`processes` > 1): the parent
serves `admin_port` from each process's own admin listener on a loopback port, as one:
`/metrics` merged (`gateway.telemetry.merge`), `/metrics/json` and `/admin/workers` as
`{"processes": [each process's answer]}`, `/ready` when every process is ready, `/health`
the parent's own. An HTTP app, so it lives with the edge; the lifecycle's supervisor
(`gateway.lifecycle.processes`) hands it the processes' ports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.edge.asgi import Receive, Scope, Send, send_error, send_json
from gateway.edge.errors import APIError
from gateway.telemetry.merge import merge_expositions

#: Seconds the parent waits on a process's admin listener.
ADMIN_TIMEOUT = 5.0


class Processes(Protocol):
    """What the proxy reads of the supervisor: each process's admin port (None: not
    known), and whether all have started."""

    @property
    def admin_ports(self) -> Sequence[int | bool | None]: ...

    @property
    def ready(self) -> bool: ...


class AdminProxy:
    """The parent's admin listener (raw ASGI): every process's admin answers as one."""

    def __init__(self, supervisor: Processes) -> None:
        self.supervisor = supervisor
        self._http: httpx.AsyncClient | None = None

    async def _get_all(self, path: str) -> list[httpx.Response | None]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=ADMIN_TIMEOUT)
        http = self._http

        async def get(port: int | None) -> httpx.Response | None:
            if port is None:
                return None
            try:
                return await http.get(f"http://127.0.0.1:{port}{path}")
            except httpx.HTTPError:
                return None

        return list(await asyncio.gather(*(get(p) for p in self.supervisor.admin_ports)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await send_error(send, APIError(405, "Method not allowed."))
        elif path == "/health":
            await send_json(send, 200, b'{"status":"ok"}', [])
        elif path == "/ready":
            answers = await self._get_all("/ready") if self.supervisor.ready else [None]
            if all(a is not None and a.status_code == 200 for a in answers):
                await send_json(send, 200, b'{"status":"ready"}', [])
            else:
                await send_json(send, 503, b'{"status":"not ready"}', [])
        elif path == "/metrics":
            answers = await self._get_all("/metrics")
            texts = [a.text if a is not None and a.status_code == 200 else None for a in answers]
            body = merge_expositions(texts)
            headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif path in ("/metrics/json", "/admin/workers"):
            answers = await self._get_all(path)
            processes = [
                {"process": index, **(a.json() if a is not None and a.status_code == 200 else {})}
                for index, a in enumerate(answers)
            ]
            await send_json(send, 200, orjson.dumps({"processes": processes}), [])
        else:
            await send_error(send, APIError(404, f"No route {path}.", code="not_found"))
