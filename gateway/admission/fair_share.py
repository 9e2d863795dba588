"""Fair share of the gateway's slots (`max_concurrent_requests`) between teams.

Slots are not queued, so fairness is decided at the door, one request at a
time, in O(teams). Let S be the slots, F those free, n(t) the slots team t
holds and w(t) its weight. A team has demand if it holds a slot, or was turned
away for want of one in the last `demand_memory` seconds (a few Retry-After
periods: a refused client is expected back). Among the teams with demand (and
the asking team), a team's share is s(t) = S * w(t) / sum(w).

A team may take a free slot (F >= 1) when

  1. it holds less than its share, n(t) < s(t); or
  2. after taking it, the free slots still cover every other team's unmet
     share: F - 1 >= sum over other teams u with demand of max(0, floor(s(u)) - n(u)).

So a team alone (no other demand) may use every slot; two teams flooding end
at their weighted shares (give or take one slot for rounding) however the
requests interleave; and a team that arrives while another holds every slot is
refused once (503 server_busy, which gives it demand), after which the other
cannot take back the slots that free up until the newcomer holds its share.
Nothing is pre-empted: requests in flight always finish.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from gateway.admission.slots import Slots
from gateway.protocol.errors import Busy
from gateway.teams.team import Team


class OverShare(Busy):
    """A team asked for more than its share while others wait: 503 server_busy."""


class FairShare:
    """Takes slots for teams by the rule above."""

    def __init__(self, slots: Slots, teams: Iterable[Team], demand_memory: float) -> None:
        self.slots = slots
        self.teams = list(teams)
        self.demand_memory = demand_memory

    def may_take(self, team: Team, now: float) -> bool:
        """Whether `team` may take a slot now."""
        total = self.slots.limit
        free = total - self.slots.in_use
        if free < 1:
            return False
        since = now - self.demand_memory
        wanting = [t for t in self.teams if t is not team and (t.slots or t.wanted_at > since)]
        weights = team.weight + sum(t.weight for t in wanting)
        if team.slots < total * team.weight / weights:
            return True
        unmet = sum(max(0, math.floor(total * t.weight / weights) - t.slots) for t in wanting)
        return free - 1 >= unmet

    @contextmanager
    def hold(self, team: Team) -> Iterator[None]:
        """Holds a slot for `team` for the body of a `with`, or raises `Busy`."""
        now = time.monotonic()
        if not self.may_take(team, now):
            team.wanted_at = now
            if self.slots.in_use < self.slots.limit:
                team.refused["fair_share"] += 1
                raise OverShare(
                    f"Team `{team.name}` holds its share of the gateway's "
                    f"{self.slots.limit} concurrent requests; others are waiting.",
                    reason="fair_share",
                )
        with self.slots.hold():
            team.slots += 1
            try:
                yield
            finally:
                team.slots -= 1
