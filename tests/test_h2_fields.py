"""HPACK for the gateway's gRPC client (`gateway.protocol.h2_fields`): the blocks it
builds read back, through hpack's decoder (an implementation not ours), as the fields
they were made of and never write the peer's table; the worker's blocks that leave its
table as it was (indexed fields, literals not indexed) are decoded once and read again
after its table changes; and over a connection
(`grpc_h2`, against a scripted HTTP/2 server that records what it gets) the table is
said to be empty in the first block and again after the server sets its table size.
Interop with gRPC's own HPACK is in `test_grpc_h2.py` (a grpc.aio server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import hpack
import pytest

from gateway.protocol.grpc_h2 import StreamChannel
from gateway.protocol.h2_fields import EMPTY_TABLE, BlockDecoder, field, fields
from tests.support.h2_script import frame

PAIRS = [
    (":method", "POST"),
    (":scheme", "https"),
    (":path", "/vllm.grpc.engine.VllmEngine/Generate"),
    (":authority", "engine-0.engines.svc:50051"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
    ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
    ("x-long", "é" * 300),  # a length past one byte's prefix, and not ASCII
]


def test_a_block_reads_back_as_its_fields_and_leaves_the_peer_table_empty() -> None:
    decoder = hpack.Decoder()
    block = EMPTY_TABLE + fields(PAIRS[:6]) + fields(PAIRS[6:], sensitive=True)
    for _ in range(2):  # the same block twice: nothing was indexed the first time
        assert [(str(k), str(v)) for k, v in decoder.decode(block)] == PAIRS
        assert not decoder.header_table.dynamic_entries
    # a credential is marked never indexed, for any intermediary
    decoded = decoder.decode(field("authorization", "Bearer k", sensitive=True))
    assert isinstance(decoded[0], hpack.NeverIndexedHeaderTuple)


def test_an_indexed_block_is_decoded_once_and_again_after_the_table_changes() -> None:
    encoder, decoder = hpack.Encoder(), BlockDecoder(64 * 1024)
    first = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    assert decoder.decode(first) == ((":status", "200"), ("content-type", "application/grpc"))
    again = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    assert min(again) >= 0x80  # indexed only: the table's first entry
    assert decoder.decode(again) is decoder.decode(again)  # kept
    # a block that writes the table shifts its entries: the same bytes now read the new one
    decoder.decode(encoder.encode([("grpc-status", "0")]))
    assert decoder.decode(again) == ((":status", "200"), ("grpc-status", "0"))


def test_a_block_of_indexed_fields_and_literals_not_indexed_is_decoded_once() -> None:
    encoder, decoder = hpack.Encoder(), BlockDecoder(64 * 1024)
    decoder.decode(encoder.encode([("grpc-status", "0")]))  # the table's first entry
    # grpcio's trailers after a connection's first call: the status indexed and an empty
    # message as a literal not indexed; then a never-indexed one, Huffman-coded and long
    note = hpack.NeverIndexedHeaderTuple("x-note", "b" * 300)
    trailers = b"\xbe" + field("grpc-message", "") + encoder.encode([note], huffman=True)
    expected = (("grpc-status", "0"), ("grpc-message", ""), ("x-note", "b" * 300))
    assert decoder.decode(trailers) == expected
    assert decoder.decode(trailers) is decoder.decode(trailers)  # kept
    # a literal with indexing writes the table: its block is decoded every time
    indexing = encoder.encode([("x-new", "1")])
    assert indexing[0] & 0xC0 == 0x40
    assert decoder.decode(indexing) is not decoder.decode(indexing)


def test_a_block_past_the_limit_is_refused_and_not_kept() -> None:
    encoder, decoder = hpack.Encoder(), BlockDecoder(100)
    decoder.decode(encoder.encode([("x-big", "v" * 60)]))
    indexed = encoder.encode([("x-big", "v" * 60), ("x-big", "v" * 60)])
    assert min(indexed) >= 0x80
    for _ in range(2):
        with pytest.raises(hpack.HPACKError):
            decoder.decode(indexed)


@asynccontextmanager
async def _recording(settings: bytes) -> AsyncIterator[tuple[int, list[bytes]]]:
    """An HTTP/2 server that sends SETTINGS with `settings` once it has a call's headers,
    records each HEADERS frame's block, and answers each call OK with no message."""
    blocks: list[bytes] = []
    writers: list[asyncio.StreamWriter] = []
    ok = hpack.Encoder()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readexactly(24)  # the preface
        while True:
            head = await reader.readexactly(9)
            payload = await reader.readexactly(int.from_bytes(head[:3], "big"))
            kind, flags, stream = head[3], head[4], int.from_bytes(head[5:9], "big")
            if kind == 0x1:
                blocks.append(payload)
                if len(blocks) == 1:
                    writer.write(frame(0x4, 0, 0, settings))
                fields = [(":status", "200"), ("content-type", "application/grpc")]
                writer.write(frame(0x1, 0x4, stream, ok.encode(fields)))
                writer.write(frame(0x1, 0x5, stream, ok.encode([("grpc-status", "0")])))
            elif kind == 0x4 and not flags & 0x1:
                writer.write(frame(0x4, 0x1, 0))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], blocks
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


def test_the_table_is_said_empty_first_and_after_the_worker_sets_its_size(
    run: Callable[[Any], Any],
) -> None:
    table_size_0 = (0x1).to_bytes(2, "big") + (0).to_bytes(4, "big")

    async def spec() -> None:
        async with _recording(table_size_0) as (port, blocks):
            channel = StreamChannel(f"127.0.0.1:{port}")
            try:
                for _ in range(3):
                    call = channel.unary_stream("/t.S/M", b"", bytes, 10, [("x-a", "b")])
                    assert await call.read() is grpc.aio.EOF
            finally:
                await channel.close()
        assert [block.startswith(EMPTY_TABLE) for block in blocks] == [True, True, False]
        decoder = hpack.Decoder(max_header_list_size=1 << 16)
        decoder.max_allowed_table_size = 0  # as the server said: decodes only if we kept to it
        for block in blocks:
            names = [str(name) for name, _ in decoder.decode(block)]
            assert names[:6] == [":method", ":scheme", ":path", ":authority", "content-type", "te"]
            assert names[6:] == ["x-a", "grpc-timeout"]

    run(spec)


@pytest.fixture
def run(server_loop: Any) -> Callable[[Any], Any]:
    return lambda spec: server_loop.call(spec())
