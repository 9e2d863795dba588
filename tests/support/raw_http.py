"""A raw TCP client of the gateway's HTTP listener, for specs that write bytes no HTTP
client would (bad heads, bodies that never come) and read what comes back."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from tests.support.waiting import HANG_GUARD


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), HANG_GUARD)
    sock.settimeout(HANG_GUARD)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything until the gateway closes (a reset counts as closed)."""
    chunks = []
    for _ in range(10_000):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
