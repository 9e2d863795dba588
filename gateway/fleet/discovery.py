"""Worker addresses from the config: fixed `host:port` (or base URLs of HTTP
upstreams), or DNS names that a Kubernetes headless Service answers with one
address per ready pod.

The names follow gRPC's target syntax: `dns:///name:port` asks the system
resolver; `dns://server:port/name:port` asks that name server.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.resolver


@dataclass(frozen=True)
class Target:
    """One entry of a model's `workers`."""

    entry: str
    host: str
    port: int
    nameserver: tuple[str, int] | None = None
    is_dns: bool = False
    is_url: bool = False


class DiscoveryError(ValueError):
    """A `workers` entry that cannot be a worker address."""


def _host_port(text: str, entry: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DiscoveryError(f"{entry!r}: expected host:port")
    return host.strip("[]"), int(port)


def parse_target(entry: str) -> Target:
    """Reads one `workers` entry."""
    if entry.startswith(("http://", "https://")):
        return Target(entry, "", 0, is_url=True)
    if not entry.startswith("dns:"):
        host, port = _host_port(entry, entry)
        return Target(entry, host, port)
    rest = entry[len("dns:") :]
    nameserver = None
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise DiscoveryError(f"{entry!r}: expected dns:///name:port")
        if authority:
            nameserver = _host_port(authority, entry)
    host, port = _host_port(rest, entry)
    return Target(entry, host, port, nameserver, is_dns=True)


async def resolve(target: Target, within: float = 5.0) -> list[str]:
    """The `ip:port` addresses a target stands for now, sorted."""
    if target.is_url:
        return [target.entry]
    if not target.is_dns:
        return [f"{target.host}:{target.port}"]
    if target.nameserver is None:
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(
                target.host, target.port, type=socket.SOCK_STREAM
            ),
            within,
        )
        # an AF_INET/AF_INET6 address's host is a str (typeshed allows AF_UNIX's int too)
        ips = {str(info[4][0]) for info in infos}
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [target.nameserver[0]]
        resolver.port = target.nameserver[1]
        resolver.lifetime = within
        try:
            answer = await resolver.resolve(target.host, "A")
        except dns.resolver.NXDOMAIN:
            return []
        except dns.resolver.NoAnswer:
            return []
        except dns.exception.DNSException as error:
            raise OSError(f"DNS lookup of {target.host} failed: {error}") from error
        ips = {record.address for record in answer}
    return sorted(f"[{ip}]:{target.port}" if ":" in ip else f"{ip}:{target.port}" for ip in ips)
