"""The fleet's httpx client for OpenAI-compatible upstreams (https, proxies), whose
connections close when a call is cancelled in their TLS handshake.

httpcore (1.0.9) closes a new connection's TCP socket when its TLS handshake fails,
but not when the handshake is cancelled: its `start_tls` catches `Exception`, and a
cancellation is not one. Every call the gateway makes runs under a deadline
(`asyncio.timeout`: a health check's `health_check_timeout`, a /models or /metrics
poll's) or ends with its client, so on a loaded machine, where the handshake is
slow, a health check that timed out left its socket to the garbage collector, which
warns (`unclosed resource <TCPTransport ...>`) and only then closes it. Here each
pool's network backend hands out streams that close their socket when `start_tls`
ends by any exception, cancellation included; the rest is httpcore's, unchanged.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

#: No bound on connections (the fleet's own limits bound the calls); idle ones kept.
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)


def http_client(verify: ssl.SSLContext | bool) -> httpx.AsyncClient:
    """An httpx client (of every proxy in the environment too) trusting `verify`,
    whose handshakes cut short close their sockets."""
    client = httpx.AsyncClient(verify=verify, limits=LIMITS)
    # httpx takes no network backend; its transports' pools (the direct one and each
    # proxy's) read theirs from this attribute at each new connection (names private to
    # httpx and httpcore, whose versions constraints.txt pins; tests/test_health_checks.py
    # fails on a socket left open)
    for transport in (client._transport, *client._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if isinstance(pool, httpcore.AsyncConnectionPool):
            pool._network_backend = _Backend(pool._network_backend)
    return client


class _Backend(httpcore.AsyncNetworkBackend):
    """`backend`'s connections, as `_Stream`s."""

    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Stream(stream)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _Stream(httpcore.AsyncNetworkStream):
    """`stream`, closed when its TLS handshake ends by any exception."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
    ) -> httpcore.AsyncNetworkStream:
        try:
            tls = await self._stream.start_tls(ssl_context, server_hostname, timeout)
        except BaseException:
            # anyio's aborts the socket at once, then awaits a turn of the loop (which
            # a second cancellation may cut: the socket is closed by then)
            await self._stream.aclose()
            raise
        return _Stream(tls)  # a proxy's TLS stream may start TLS again (to the upstream)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)
