"""HPACK (RFC 7541) for the gateway's gRPC client (`gateway.protocol.grpc_h2`): a
call's header block assembled from bytes made once per method, and a worker's header
blocks decoded once per form.

Why: in the gateway, between a request's other work, hpack's `Encoder` took about
100 µs of CPU a call and its `Decoder` as much again for the call's two blocks back
(its headers and its trailers): a tenth of a streamed request's CPU on the vllm-grpc
path, all of it before the first token reaches the client.

Out: every field is a literal that does not enter the peer's dynamic table
(§6.2.2; a metadata value, which may be a credential, "never indexed", §6.2.3), its
name from the static table where the table has it, its value not Huffman-coded. So a
method's fixed fields (`:method`, `:scheme`, `:path`, `:authority`, `content-type`,
`te`) are encoded once, and a call adds only its metadata and `grpc-timeout`. Our
table is said to be empty (a size update to 0, §6.3) at the start of a connection's
first block and of the first block after the worker sets its
SETTINGS_HEADER_TABLE_SIZE, as a decoder that lowered it may require.

In: hpack's `Decoder`, whose dynamic table the worker's blocks write. A block made
only of indexed fields (§6.1) and literals not indexed (§6.2.2, §6.2.3) reads that
table and does not change it, so its decoding is kept, by its bytes, until a block that
writes the table (a literal with indexing, §6.2.1, or a size update, §6.3) is decoded.
Those are the usual headers and trailers of a gRPC server after a connection's first
call: grpcio's trailers are `grpc-status` indexed and an empty `grpc-message` as a
literal not indexed, which, when only indexed fields were kept, made both blocks of
every call miss (hpack's decoding of them: about 1,400 bytecodes a call).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import hpack

#: Fields of the static table (RFC 7541 Appendix A) this client sends: an index of a
#: whole field (name and value), or of a name.
_STATIC_FIELDS = {(":method", "POST"): 3, (":scheme", "http"): 6, (":scheme", "https"): 7}
_STATIC_NAMES = {":authority": 1, ":path": 4, "content-type": 31}
#: The first byte's flags: an indexed field; literals without indexing, never indexed.
_INDEXED, _WITHOUT_INDEXING, _NEVER_INDEXED = 0x80, 0x00, 0x10
#: A dynamic table size update to 0: our table holds nothing.
EMPTY_TABLE = b"\x20"
#: A decoded block's fields, in order (kept ones are shared: a tuple).
Fields = tuple[tuple[str, str], ...]
#: Decoded indexed-only blocks kept at most (a gRPC server sends two or three forms).
_KEPT_BLOCKS = 32


def _integer(value: int, prefix_bits: int, flags: int) -> bytes:
    """`value` in HPACK's integer form (§5.1) behind `flags` in the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((flags | value,))
    out = bytearray((flags | limit,))
    value -= limit
    while value >= 0x80:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(text: str) -> bytes:
    data = text.encode()
    size = len(data)
    return (bytes((size,)) if size < 0x7F else _integer(size, 7, 0)) + data


@functools.lru_cache(maxsize=256)
def _name(name: str, sensitive: bool) -> bytes:
    """A literal field's bytes before its value: kept, as every call sends the same few
    names (its metadata's, `grpc-timeout`) with values of its own."""
    flags = _NEVER_INDEXED if sensitive else _WITHOUT_INDEXING
    index = _STATIC_NAMES.get(name)
    if index is not None:
        return _integer(index, 4, flags)
    return bytes((flags,)) + _string(name)


def field(name: str, value: str, *, sensitive: bool = False) -> bytes:
    """One field (`name` in lower case) as a literal the peer does not index."""
    whole = _STATIC_FIELDS.get((name, value))
    if whole is not None:
        return _integer(whole, 7, _INDEXED)
    return _name(name, sensitive) + _string(value)


def fields(pairs: list[tuple[str, str]], *, sensitive: bool = False) -> bytes:
    """`pairs`, in order, as one piece of a header block."""
    return b"".join(field(name, value, sensitive=sensitive) for name, value in pairs)


def metadata_fields(metadata: Iterable[tuple[str, str]]) -> bytes:
    """A call's metadata (names in any case) as `fields` of their names in lower case,
    never indexed (a value may be a credential): one list made, not two."""
    return b"".join([field(name.lower(), value, sensitive=True) for name, value in metadata])


#: `grpc-timeout`'s bytes before its value.
_TIMEOUT_NAME = _name("grpc-timeout", False)


def timeout_field(value: str) -> bytes:
    """`field("grpc-timeout", value)` for `grpc_h2.grpc_timeout`'s value (at most 8 digits
    and a unit: ASCII, its length one byte), every call's."""
    return _TIMEOUT_NAME + bytes((len(value),)) + value.encode()


class BlockDecoder:
    """A connection's decoder of the worker's header blocks (hpack's, with its limit on
    a block's decoded size), indexed-only blocks decoded once while the table holds."""

    __slots__ = ("_decoder", "_known")

    def __init__(self, max_header_list_size: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_size)
        self._known: dict[bytes, Fields] = {}

    def decode(self, block: bytes) -> Fields:
        """The block's fields as text; raises `hpack.HPACKError` for one HPACK refuses."""
        known = self._known.get(block)
        if known is not None:
            return known
        decoded = tuple((str(name), str(value)) for name, value in self._decoder.decode(block))
        if _leaves_table(block):  # read the table, left it as it was
            if len(self._known) >= _KEPT_BLOCKS:
                self._known.clear()
            self._known[block] = decoded
        else:  # it may have written the table: what was kept may now read otherwise
            self._known.clear()
        return decoded


def _integer_at(block: bytes, at: int, prefix_bits: int) -> tuple[int, int]:
    """The integer (§5.1) whose first byte is `block[at]`, and where it ends."""
    limit = (1 << prefix_bits) - 1
    value = block[at] & limit
    at += 1
    if value < limit:
        return value, at
    shift = 0
    while True:
        byte = block[at]
        at += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _leaves_table(block: bytes) -> bool:
    """Whether decoding `block` (one hpack has decoded) leaves the dynamic table as it
    was: only indexed fields and literals not indexed, each walked over by its lengths."""
    at, end = 0, len(block)
    try:
        while at < end:
            first = block[at]
            if first & _INDEXED:
                _, at = _integer_at(block, at, 7)
                continue
            if first & 0x60:  # with indexing (01), or a table size update (001)
                return False
            name, at = _integer_at(block, at, 4)
            for _ in range(1 if name else 2):  # the name's string, if new; the value's
                length, at = _integer_at(block, at, 7)
                at += length
        return at == end
    except IndexError:
        return False
