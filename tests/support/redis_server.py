"""A throwaway `redis-server` for the tests of shared limits: started, stopped,
and stalled (SIGSTOP) the way a real Redis fails."""

from __future__ import annotations

import signal
import socket
import subprocess

from tests.support.processes import free_port
from tests.support.waiting import HANG_GUARD, wait_until


class RedisServer:
    """A throwaway `redis-server` on a loopback port, with nothing saved."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_until(self.answers, "redis-server to answer", timeout=HANG_GUARD)

    def answers(self) -> bool:
        """Whether it answers a PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16) == b"+PONG\r\n"
        except OSError:
            return False

    def stall(self) -> None:
        """Stops the process (SIGSTOP): connections stay open, nothing answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Lets a stalled process go on (SIGCONT): it runs what it was sent meanwhile."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)  # a stalled process must hear SIGTERM
        self.process.terminate()
        self.process.wait(HANG_GUARD)
