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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class WorkerCredentials:
    """What a secure channel to a worker needs: credentials and channel options."""

    credentials: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = ()


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
    return WorkerCredentials(credentials, options)


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials:
    """A worker's server credentials; mutual TLS when a client CA is given."""
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=_read(tls.client_ca_file),
        require_client_auth=tls.client_ca_file is not None,
    )
