"""The bytes of request bodies being read, bounded for the whole process and for each
team, so that many clients (or one key over many connections) sending large bodies
slowly cannot hold the gateway's memory until `body_timeout`: 100 connections of one
key each sending a 4 MiB body and waiting had held +403 MiB (issue 25).

A body's bytes are counted as they arrive (all at once from its Content-Length, when it
declares one) and given back once it is read; a body that would pass a bound is refused
before more of it is read: past the process's `max_body_bytes_in_flight` a 503
server_busy, past its team's `max_team_body_bytes_in_flight` a 429. A body is never
refused while nothing else of its process (or team) is being read, so one body up to
`max_body_bytes` always passes. Cost: two integer additions and comparisons per chunk.
"""

from __future__ import annotations

from gateway.protocol import errors
from gateway.teams import Team


class BodyBytes:
    """The bodies being read in this process, in bytes, in all and by team."""

    __slots__ = ("by_team", "in_flight", "limit", "retry_after", "team_limit")

    def __init__(self, limit: int, team_limit: int, retry_after: int) -> None:
        self.limit = limit
        self.team_limit = team_limit
        self.retry_after = max(1, retry_after)
        self.in_flight = 0
        self.by_team: dict[str, int] = {}

    def meter(self, team: Team | None) -> BodyMeter:
        """The meter of one body, sent by `team` (None: an open gateway)."""
        return BodyMeter(self, team.name if team is not None else None)


class BodyMeter:
    """One body's bytes while it is read: `take` what arrives, `release` once read."""

    __slots__ = ("_bodies", "_team", "held")

    def __init__(self, bodies: BodyBytes, team: str | None) -> None:
        self._bodies = bodies
        self._team = team
        self.held = 0

    def take(self, size: int) -> None:
        """Counts `size` more bytes of the body, or refuses it (`Busy`, `RateLimited`)."""
        bodies, team = self._bodies, self._team
        others = bodies.in_flight - self.held
        if others and bodies.in_flight + size > bodies.limit:
            raise errors.Busy(
                f"The gateway is reading {bodies.limit} bytes of request bodies; "
                "send the request again.",
                reason="body_bytes",
            )
        if team is not None:
            held = bodies.by_team.get(team, 0)
            if held - self.held and held + size > bodies.team_limit:
                raise errors.RateLimited(
                    f"Team `{team}` is sending {bodies.team_limit} bytes of request bodies "
                    f"at once (its limit). Please try again in {bodies.retry_after}s.",
                    retry_after=bodies.retry_after,
                    reason="team_body_bytes",
                )
            bodies.by_team[team] = held + size
        bodies.in_flight += size
        self.held += size

    def release(self) -> None:
        """Gives back what the body held (once read, or refused)."""
        held, self.held = self.held, 0
        if not held:
            return
        bodies = self._bodies
        bodies.in_flight -= held
        if self._team is not None:
            left = bodies.by_team[self._team] - held
            if left:
                bodies.by_team[self._team] = left
            else:
                del bodies.by_team[self._team]
