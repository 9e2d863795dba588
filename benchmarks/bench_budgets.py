"""What budgets add to admission: CPU per request of the budgets stage and its
settlement (gateway.teams.accounts: `reserve` at admission, `settle` at the
end, the ledger's row included) with budgets off, in memory, and in Redis.

    .venv/bin/python -m benchmarks.bench_budgets [--requests 5000]

Each request reserves on a team with a day and a month budget and settles to
its usage, one after another on one event loop; the process's own CPU time
(`time.process_time`) per request is reported, and for Redis the wall time too
(the round trips to a `redis-server` on loopback, started for the run; the
server's own CPU is not counted). "off" is a team without budgets: the ledger
row alone.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import time
from typing import Any

from gateway.config import parse_config
from gateway.protocol.types import GenerateRequest, SamplingParams
from gateway.teams.accounts import Accounts
from gateway.teams.redis_store import RedisStore
from gateway.teams.team import Team
from gateway.telemetry.record import RequestRecord


def _config(budgets: bool, redis_url: str | None = None) -> Any:
    team: dict[str, Any] = {}
    if budgets:
        team["budgets"] = [
            {"window": "day", "tokens": 10**12},
            {"window": "month", "tokens": 10**13},
        ]
    raw: dict[str, Any] = {
        "models": [{"name": "m", "workers": ["127.0.0.1:1"]}],
        "teams": {"alpha": team},
    }
    if redis_url is not None:
        raw["redis_url"] = redis_url
    return parse_config(raw, env={})


async def _run(config: Any, requests: int, store: RedisStore | None) -> tuple[float, float]:
    """CPU and wall seconds per request of `requests` reserve + settle pairs."""
    team = Team(config.teams[0])
    accounts = Accounts(config, [team], store)
    request = GenerateRequest(
        request_id="r", model="m", prompt="a b c d " * 16, sampling=SamplingParams(max_tokens=64)
    )
    for _ in range(50):  # warm up (and open the Redis connection)
        held = await accounts.reserve(team, "k", "m", request)
        await accounts.settle(team, "k", "m", held, _record())
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(requests):
        record = _record()
        held = await accounts.reserve(team, "k", "m", request)
        await accounts.settle(team, "k", "m", held, record)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await accounts.ledger.flush()
    return cpu / requests, wall / requests


def _record() -> RequestRecord:
    record = RequestRecord("r")
    record.prompt_tokens, record.completion_tokens, record.tokens_sent = 33, 64, 64
    return record


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _redis_row(url: str, requests: int) -> tuple[float, float]:
    store = RedisStore(url, 1.0, "bench")
    try:
        return await _run(_config(True, url), requests, store)
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    rows = [
        ("off", asyncio.run(_run(_config(False), args.requests, None))),
        ("local", asyncio.run(_run(_config(True), args.requests, None))),
    ]
    if shutil.which("redis-server"):
        port = _free_port()
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            url = f"redis://127.0.0.1:{port}/0"
            rows.append(("redis", asyncio.run(_redis_row(url, args.requests))))
        finally:
            server.terminate()
            server.wait(10)
    off = rows[0][1][0]
    print(f"{'budgets':8} {'CPU µs/request':>15} {'added µs':>9} {'wall µs/request':>16}")
    for name, (cpu, wall) in rows:
        print(f"{name:8} {cpu * 1e6:15.1f} {(cpu - off) * 1e6:9.1f} {wall * 1e6:16.1f}")


if __name__ == "__main__":
    main()
