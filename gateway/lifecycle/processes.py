"""Several gateway processes on one port: `furnace-gateway serve --workers N`.

One Python process uses one core at most (one event loop, one GIL). On a pod
with several cores the gateway runs N processes, each the whole gateway of
`gateway.lifecycle` (its own loop, fleet, channels, slots and metrics), each
listening on the same port with SO_REUSEPORT: the kernel hands every new
connection to one of them (by a hash of its addresses), with no hop through a
parent and no shared accept lock.

What stays exact across the processes, and what does not:

- slots: process i gets its share of `max_concurrent_requests` (total / N, the
  remainder to the first ones), so the gateway never serves more than the total
  at once; but a process whose share is taken answers 503 while another may
  still have a free slot (connections, not requests, are spread: keep N small
  next to the slots, and the total a multiple of N). `max_connections` is split
  the same way; a queue (`queue`) is per process.
- team limits: with `redis_url` they live in Redis, exact across the processes
  as across replicas. Without it each process enforces its share of each limit
  (exact as a ceiling; a team whose traffic lands unevenly can be refused
  before it reaches its total), and a limit smaller than N cannot be split:
  refused at start.

This module's parent process serves no traffic. It checks the port is free and
holds it (a bound, not listening, SO_REUSEPORT socket, so port 0 names one port
for every process), spawns the processes (fresh interpreters: nothing of the
parent's state is inherited), and once all are ready serves the admin listener
(`admin_port`, `gateway.edge.admin_proxy`) from their own admin listeners on loopback
ports: `/metrics` is
every process's metrics, each sample labelled `process="i"`; `/metrics/json`
and `/admin/workers` answer `{"processes": [each process's answer]}`; `/ready`
is 200 while every process is ready. SIGTERM (or SIGINT) goes on to every
process, and each drains as one gateway does; the parent exits once all have,
0 if all did. A process that dies on its own stops the others and the parent
exits 1 (a pod restarts whole, rather than serve with a share of its slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn

from gateway import log_setup
from gateway.config import Config, ConfigError, TeamConfig
from gateway.edge.admin_proxy import AdminProxy
from gateway.lifecycle import (
    GatewayServer,
    _bind,
    _StopSignals,
    keep_dates,
    run,
    shared_port_socket,
    uvicorn_config,
)

log = logging.getLogger("furnace")

#: Team limits split across the processes when no Redis holds them.
TEAM_LIMITS = ("max_concurrent_requests", "requests_per_minute", "tokens_per_minute")


def share(total: int, count: int, index: int) -> int:
    """Process `index`'s part of `total` over `count` processes (the parts add up)."""
    base, extra = divmod(total, count)
    return base + (1 if index < extra else 0)


def check_split(config: Config, count: int) -> None:
    """Raises `ConfigError` for what cannot be split over `count` processes."""
    if config.max_concurrent_requests < count:
        raise ConfigError(
            f"max_concurrent_requests: {config.max_concurrent_requests} slots cannot be "
            f"shared by {count} processes (at least one each)"
        )
    if config.redis_url is not None:
        return
    for team in config.teams:
        for name in TEAM_LIMITS:
            limit = getattr(team, name)
            if limit is not None and limit < count:
                raise ConfigError(
                    f"teams.{team.name}.{name}: {limit} cannot be split over {count} "
                    "processes; set redis_url (exact across processes) or fewer processes"
                )


def process_config(config: Config, count: int, index: int) -> Config:
    """Process `index`'s config: its share of the slots, the connections and (without
    Redis) each team's limits and budgets; its admin listener, if any, on a loopback
    port. A reloaded config file gets the same share (`GatewayServer`'s `share`)."""
    teams = config.teams
    if config.redis_url is None:
        teams = tuple(_team_share(team, count, index) for team in teams)
    connections = config.max_connections  # 0 (its default) stays 0: each process takes
    if connections:  # its own from its own open-file limit
        connections = max(1, share(connections, count, index))
    admin: dict[str, Any] = {}
    if config.admin_port is not None:
        admin = {"admin_port": 0, "admin_host": "127.0.0.1"}
    return dataclasses.replace(
        config,
        max_concurrent_requests=share(config.max_concurrent_requests, count, index),
        max_connections=connections,
        teams=teams,
        **admin,
    )


def _team_share(team: TeamConfig, count: int, index: int) -> TeamConfig:
    limits: dict[str, Any] = {
        name: share(limit, count, index)
        for name in TEAM_LIMITS
        if (limit := getattr(team, name)) is not None
    }
    budgets = tuple(
        dataclasses.replace(
            budget,
            tokens=None if budget.tokens is None else share(budget.tokens, count, index),
            spend=None if budget.spend is None else budget.spend / count,
        )
        for budget in team.budgets
    )
    return dataclasses.replace(team, budgets=budgets, **limits)


# --- one of the processes ----------------------------------------------------------------


def _die_with_parent() -> None:
    """Asks Linux for a SIGTERM (a drain) when the parent dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _process_main(
    config: Config,
    index: int,
    ready: Connection,
    config_file: str | None = None,
    count: int = 1,
) -> None:
    """A spawned process: one gateway on the shared port (reading `config_file` again
    when it changes, as a single gateway does); sends its admin port (or None) on
    `ready` once it serves."""
    log_setup.configure(config.log_level.upper(), batched=True)
    log_setup.use_format(config.log_format)
    # A group of its own: a terminal's Ctrl-C reaches the parent alone, which passes
    # one SIGTERM on (the process would otherwise take the parent's as a second signal
    # and cut its drain short).
    os.setpgid(0, 0)
    if sys.platform == "linux":
        _die_with_parent()
    with contextlib.suppress(KeyboardInterrupt):
        run(
            _serve_process(
                config, ready, config_file, partial(process_config, count=count, index=index)
            )
        )


async def _serve_process(
    config: Config,
    ready: Connection,
    config_file: str | None,
    share: Callable[[Config], Config],
) -> None:
    server = GatewayServer(config, reuse_port=True, config_file=config_file, share=share)
    await server.serve(on_ready=lambda: ready.send(server.admin_port))


# --- the parent ----------------------------------------------------------------------------


def serve_processes(config: Config, count: int, config_file: str | None = None) -> int:
    """Runs `count` gateway processes on the config's port until SIGTERM or SIGINT;
    returns the exit status. Raises `ConfigError` if the config cannot be split."""
    check_split(config, count)
    family, kind, proto, _, address = socket.getaddrinfo(
        config.host, config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:  # without SO_REUSEPORT: fails if taken
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            log.error("cannot bind %s:%d: %s", config.host, config.port, error)
            return 1
        port = probe.getsockname()[1]
    return run(Supervisor(dataclasses.replace(config, port=port), count, config_file).serve())


class Supervisor:
    """Starts the processes, serves the admin listener, forwards the signals."""

    def __init__(self, config: Config, count: int, config_file: str | None = None) -> None:
        self.config = config
        self.count = count
        self.config_file = config_file
        self.processes: list[BaseProcess] = []
        self.admin_ports: list[int | None] = []
        self.ready = False
        self.admin: uvicorn.Server | None = None

    async def serve(self) -> int:
        """Starts every process, then waits for a signal (or a process's death). A signal
        that comes while they start is taken once they are up: the default action would
        end this process at once and its children with it, with no drain."""
        async with _StopSignals() as signals:
            holder = shared_port_socket(self.config.host, self.config.port)  # the port, held
            try:
                if not await self._start():
                    self._signal_all(signal.SIGTERM)
                    await self._wait_all()
                    return 1
            finally:
                holder.close()
            dates: asyncio.Task[None] | None = None
            if self.config.admin_port is not None:
                self.admin = self._admin_server()
                await _bind(self.admin)
                dates = asyncio.ensure_future(keep_dates([self.admin]))
            self.ready = True
            log.info("serving with %d processes on port %d", self.count, self.config.port)
            failed = False
            first_exit = asyncio.ensure_future(self._first_exit())
            stop = asyncio.ensure_future(signals.next())
            await asyncio.wait((first_exit, stop), return_when=asyncio.FIRST_COMPLETED)
            self.ready = False
            if stop.done():
                log.info("stopping: every process drains")
            else:
                failed = True
                stop.cancel()
                log.error("a gateway process exited on its own: stopping the others")
            self._signal_all(signal.SIGTERM)
            everyone = asyncio.ensure_future(self._wait_all())
            while not everyone.done():  # a second signal cuts every drain short
                again = asyncio.ensure_future(signals.next())
                await asyncio.wait((everyone, again), return_when=asyncio.FIRST_COMPLETED)
                if again.done():
                    self._signal_all(signal.SIGTERM)
                else:
                    again.cancel()
            first_exit.cancel()
        if dates is not None:
            dates.cancel()
        if self.admin is not None:
            await self.admin.shutdown()
        codes = [p.exitcode for p in self.processes]
        return 1 if failed or any(code != 0 for code in codes) else 0

    async def _start(self) -> bool:
        """Spawns the processes and waits for each to be ready; False if one failed."""
        context = multiprocessing.get_context("spawn")
        waits = []
        for index in range(self.count):
            receiver, sender = context.Pipe(duplex=False)
            config = process_config(self.config, self.count, index)
            process = context.Process(
                target=_process_main,
                args=(config, index, sender, self.config_file, self.count),
                name=f"furnace-gateway-{index}",
            )
            process.start()
            sender.close()
            self.processes.append(process)
            waits.append(asyncio.get_running_loop().run_in_executor(None, _receive, receiver))
        self.admin_ports = list(await asyncio.gather(*waits))
        if any(port is False for port in self.admin_ports):
            log.error("a gateway process failed to start")
            return False
        return True

    def _signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    async def _first_exit(self) -> None:
        await asyncio.wait(
            [asyncio.ensure_future(_exited(p)) for p in self.processes],
            return_when=asyncio.FIRST_COMPLETED,
        )

    async def _wait_all(self) -> None:
        await asyncio.gather(*(_exited(p) for p in self.processes))

    def _admin_server(self) -> uvicorn.Server:
        """The parent's admin listener, set up as every listener of the gateway."""
        config = self.config
        host, port = config.admin_host or config.host, config.admin_port or 0
        return uvicorn.Server(uvicorn_config(config, AdminProxy(self), host, port))


def _receive(connection: Connection) -> int | bool | None:
    """What a process sends once ready (its admin port, or None); False if it died first."""
    try:
        return connection.recv()  # type: ignore[no-any-return]
    except EOFError:
        return False
    finally:
        connection.close()


async def _exited(process: BaseProcess) -> None:
    """Returns once `process` has exited."""
    if process.exitcode is not None:
        return
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def exited() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(process.sentinel, exited)
    try:
        await done
    finally:
        loop.remove_reader(process.sentinel)
    process.join()


__all__ = ["Supervisor", "check_split", "process_config", "serve_processes"]
