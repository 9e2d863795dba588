"""What this process holds (open fds, resident memory), read from /proc, for the
leak checks of the abuse tests and the soak benchmark. The gateway of the tests
runs in the test process, so its sockets and buffers are counted here.

Cost: one directory listing and one small file read per snapshot (Linux only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tests.support.waiting import wait_until

MIB = 1024 * 1024


def open_fds(pid: int | str = "self") -> int:
    """The open file descriptors of a process (sockets included)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int | str = "self") -> int:
    """The resident memory of a process, in bytes."""
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Usage:
    """One snapshot of what the process holds."""

    fds: int
    rss: int

    @classmethod
    def now(cls) -> Usage:
        return cls(open_fds(), rss_bytes())

    def assert_back_near(self, fd_slack: int = 16, rss_slack: int = 256 * MIB) -> None:
        """Waits until the fds are back within `fd_slack` of this snapshot, then
        checks the resident memory grew by less than `rss_slack` (a generous bound:
        allocators keep freed memory)."""
        wait_until(lambda: open_fds() <= self.fds + fd_slack, f"open fds back near {self.fds}")
        grown = rss_bytes() - self.rss
        assert grown < rss_slack, f"RSS grew by {grown / MIB:.0f} MiB"
