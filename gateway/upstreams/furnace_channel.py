"""What the gateway's gRPC upstreams share: one way to open a worker's channel (the
options of `gateway.protocol.grpc_options`, TLS when configured), and, for our worker
protocol (`furnace_grpc` and `furnace_multiplex` alike), the translation of a failed call
into the error tree through the one table in `gateway.protocol.status`."""

from __future__ import annotations

import grpc

from gateway.protocol import errors
from gateway.protocol.grpc_options import CHANNEL_OPTIONS
from gateway.protocol.status import error_from_status
from gateway.protocol.tls import WorkerCredentials


def open_channel(address: str, credentials: WorkerCredentials | None) -> grpc.aio.Channel:
    """A channel to `address` on the running loop: plain, or TLS (mutual when the
    credentials hold a client certificate)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + credentials.options
    return grpc.aio.secure_channel(address, credentials.credentials, options)


#: What grpc says when a message passes `grpc.max_receive_message_length`.
_TOO_LARGE = "Received message larger than max"


def from_rpc_error(error: grpc.RpcError) -> errors.GatewayError:
    """A failed call as our error, through `gateway.protocol.status`'s table."""
    if isinstance(error, grpc.aio.AioRpcError):
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in (
            error.details() or ""
        ):
            # our own receive cap, not a busy worker: a retry would fail the same way
            return errors.Failed("The engine worker sent a message larger than the gateway takes.")
        return error_from_status(error.code(), error.details(), error.trailing_metadata())
    return errors.Unavailable(f"engine worker call failed: {error}")
