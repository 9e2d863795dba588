"""TLS on the worker protocol, both ends, from PEM files.

A client's channels (the gateway's `worker_tls`): the workers' certificates
checked against `ca_file` (or the system's roots), the gateway's own
certificate and key sent when a worker asks for one (mutual TLS), and
`server_name` for workers whose certificates name a host other than the one
dialled. A worker (`WorkerServer(..., tls=ServerTLS(...))`, or `furnace-gateway
worker --tls-cert --tls-key [--tls-client-ca]`) serves its certificate and,
given a client CA, accepts only clients with a certificate that CA signed.

A failed handshake (an unknown CA, a wrong name, no client certificate) fails
the connection, not a call: gRPC reports it as UNAVAILABLE, so the gateway
answers 503 `engine_unavailable` and the fleet marks the worker unreachable,
logging the handshake error. 502 `engine_auth_failed` stays for workers that
answer UNAUTHENTICATED or PERMISSION_DENIED themselves.

Certificates rotate without a restart (cert-manager renews them in place). A
worker's credentials ask `ReloadingServerTLS` on each handshake, which stats
the files (a few microseconds) and reads them again only when one changed. A
client's channel credentials are fixed per channel in gRPC, so the gateway's
fleet stats its files (`files_stamp`) and, on a change, builds new credentials
and new channels (gateway/fleet/__init__.py).
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("furnace.tls")

#: What says a file changed: its inode (a Kubernetes Secret's symlink swap),
#: modification time and size; None for a file missing.
FilesStamp = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class WorkerCredentials:
    """What a secure channel to a worker needs: credentials and channel options; and
    the same as an `ssl` context (`context`, with `server_name`) for the gateway's own
    HTTP/2 client (`gateway.protocol.grpc_h2`), None where the files make none."""

    credentials: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = ()
    context: ssl.SSLContext | None = None
    server_name: str | None = None


@dataclass(frozen=True)
class ServerTLS:
    """A worker's certificate and key, and the CA its clients' certificates must
    come from (None: any client, as with plain TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def client_credentials(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
    server_name: str | None = None,
) -> WorkerCredentials:
    """Credentials for channels to TLS workers, read from the files once: the
    workers' CA (None: the system's roots), the client's certificate and key
    for mutual TLS, and the name the workers' certificates hold when it is not
    the host dialled."""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file),
        certificate_chain=_read(cert_file),
    )
    options = () if server_name is None else (("grpc.ssl_target_name_override", server_name),)
    context: ssl.SSLContext | None = None
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file is not None:
            context.load_cert_chain(cert_file, key_file)
        context.set_alpn_protocols(["h2"])  # gRPC's servers speak HTTP/2 only after it
    except (OSError, ValueError) as error:
        # gRPC reads the same bytes only at a handshake, and fails the calls then
        log.warning("worker TLS: %s; vllm-grpc streams stay on grpc.aio", error)
        context = None
    return WorkerCredentials(credentials, options, context, server_name)


def files_stamp(*paths: str | None) -> FilesStamp:
    """A cheap fingerprint of files (one stat each): it changes when one is rewritten."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        stamps.append(None if st is None else (st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(stamps)


def _server_configuration(tls: ServerTLS) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=_read(tls.client_ca_file),
    )


class ReloadingServerTLS:
    """gRPC's certificate fetcher for a worker: called on each handshake, it
    returns a new configuration when the files changed, None to keep the last.
    A file caught half-written is tried again on the next handshake."""

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._stamp = self._files()
        self.initial = _server_configuration(tls)

    def _files(self) -> FilesStamp:
        return files_stamp(self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = self._files()
        if stamp == self._stamp:
            return None
        try:
            configuration = _server_configuration(self.tls)
        except OSError as error:
            log.warning("worker TLS: cannot read the rotated certificate yet: %s", error)
            return None
        self._stamp = stamp
        log.info("worker TLS: certificate files changed; new handshakes use them")
        return configuration


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """A worker's server credentials, reloaded when the files change; mutual TLS
    when a client CA is given."""
    fetcher = ReloadingServerTLS(tls)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial,
        fetcher,  # type: ignore[arg-type]  # the stubs omit that None keeps the last
        require_client_authentication=tls.client_ca_file is not None,
    )
