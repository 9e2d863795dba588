"""The gRPC options of both ends of the worker protocol, declared once: the gateway's
channels to workers (`gateway.upstreams.furnace_channel`) and the workers' servers (our
worker SDK's and the tensor worker's) take them from here, so the largest message either
end sends or takes is one number."""

from __future__ import annotations

#: The largest message either end sends or takes (gRPC's default is 4 MiB): prompts of
#: many MB, tensors, a multiplexed call's batch of starts (`protocol.multiplex`).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: What both ends set.
MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

#: The gateway's channel to a worker. Loopback and in-cluster links: keep connections
#: warm, reconnect soon.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    *MESSAGE_OPTIONS,
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # A fixed receive window (no BDP probing, which grows it to megabytes): a stream whose
    # client stops reading pushes back on its worker after 64 KiB, not after many MB.
    ("grpc.http2.bdp_probe", 0),
)

#: A worker's server: it lets the gateway's keepalive pings through (every 30 s, above
#: the 10 s it allows), idle calls or not.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *MESSAGE_OPTIONS,
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
)
