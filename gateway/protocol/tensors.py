"""Tensors of the KServe v2 inference protocol, on our side of the wire: the 13 datatypes,
JSON tensors checked (datatype, shape against data length, each value's type and range) and
flattened row-major, and the raw little-endian contents gRPC carries, both ways.

Pure Python (`struct`), no numpy and no protobuf: the edge checks a request with it before
any worker is called, and the KServe upstream packs it. The cost: one `struct` call per tensor
each way, and a Python list of its values; a 4 MB FP32 tensor is a million floats.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import errors

#: struct's letter for each fixed-size datatype (little-endian); BYTES is length-prefixed.
FORMATS: dict[str, str] = {
    "BOOL": "?",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "FP16": "e",
    "FP32": "f",
    "FP64": "d",
}
DATATYPES = (*FORMATS, "BYTES")
_INT_BITS = {"UINT8": 8, "UINT16": 16, "UINT32": 32, "UINT64": 64}
_INT_BITS |= {"INT8": 8, "INT16": 16, "INT32": 32, "INT64": 64}

Value = bool | int | float | str | bytes


@dataclass(slots=True)
class Tensor:
    """One tensor: its values flat, row-major."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)
    #: The values as raw contents, when they came that way (the binary extension, a worker's
    #: raw output): sent on as they are, with no packing.
    raw: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        """The tensor in the protocol's JSON; BYTES as text (undecodable bytes replaced)."""
        data = self.data
        if self.raw is not None and not data and self.datatype != "BYTES":
            data = from_raw(self.datatype, self.shape, self.raw)
        if self.datatype == "BYTES":
            data = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in data]
        elif self.datatype.startswith("FP") and not all(map(math.isfinite, data)):
            data = [_json_float(v) for v in data]
        out: dict[str, Any] = {
            "name": self.name,
            "datatype": self.datatype,
            "shape": list(self.shape),
            "data": data,
        }
        if self.parameters:
            out["parameters"] = self.parameters
        return out


#: The typed contents field of each datatype in the gRPC messages (FP16 travels raw only).
TYPED_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _json_float(value: float) -> float | str:
    # JSON has no NaN or infinities; the protocol's servers write them as strings
    return value if math.isfinite(value) else str(value)


def _bad(message: str, param: str) -> errors.Invalid:
    return errors.Invalid(message, param=param)


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


#: How deep `data` may nest when the shape's rank is less: Triton flattens any nesting (a
#: shape [4] may come as [[0, 1], [2, 3]]), and numpy's arrays have at most 64 dimensions.
MAX_NESTING = 64


def _flatten(data: list[Any], depth: int, where: str) -> list[Any]:
    """`data`'s values row-major, walked with a stack of iterators (no recursion: a body
    nested a thousand deep must be a 400, not a RecursionError); lists nested deeper than
    `depth` are refused."""
    into: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= depth:
                    raise _bad(
                        f"{where}: data is nested deeper than {depth} lists",
                        where,
                    )
                stack.append(iter(item))
                break
            into.append(item)
        else:
            stack.pop()
    return into


def _check_value(value: Any, datatype: str, where: str) -> Value:
    if datatype == "BOOL":
        if isinstance(value, bool):
            return value
        raise _bad(f"{where}: expected a boolean for BOOL, got {value!r}", where)
    if datatype in _INT_BITS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(f"{where}: expected an integer for {datatype}, got {value!r}", where)
        bits = _INT_BITS[datatype]
        low, high = (
            (0, 2**bits - 1) if datatype[0] == "U" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        )
        if not low <= value <= high:
            raise _bad(f"{where}: {value} is out of range for {datatype}", where)
        return value
    if datatype == "BYTES":
        if isinstance(value, str):
            return value.encode()
        raise _bad(f"{where}: expected a string for BYTES, got {value!r}", where)
    # FP16, FP32, FP64
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(f"{where}: expected a number for {datatype}, got {value!r}", where)
    if isinstance(value, str):
        if value.lower() not in ("nan", "inf", "-inf", "infinity", "-infinity"):
            raise _bad(f"{where}: expected a number for {datatype}, got {value!r}", where)
        return float(value)
    try:
        struct.pack("<" + FORMATS[datatype], value)
    except (OverflowError, struct.error):
        raise _bad(f"{where}: {value!r} is out of range for {datatype}", where) from None
    return float(value)


def _fast_check(flat: list[Any], datatype: str) -> list[Any] | None:
    """The values when all are right, checked in bulk (one pass over their types, one
    `struct` call or a min and a max); None when any is not, or the types are mixed."""
    if not flat or datatype == "BYTES":
        return None
    kinds = set(map(type, flat))
    if datatype == "BOOL":
        return flat if kinds == {bool} else None
    if datatype in _INT_BITS:
        if kinds != {int}:
            return None
        bits = _INT_BITS[datatype]
        low, high = (
            (0, 2**bits - 1) if datatype[0] == "U" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        )
        return flat if low <= min(flat) and max(flat) <= high else None
    if not kinds <= {int, float}:
        return None
    try:
        struct.pack(f"<{len(flat)}{FORMATS[datatype]}", *flat)
    except (OverflowError, struct.error):
        return None
    return flat if kinds == {float} else [float(v) for v in flat]


def tensor_from_json(raw: Any, where: str) -> Tensor:
    """One JSON input tensor checked and flattened; `errors.Invalid` says what is wrong."""
    if not isinstance(raw, Mapping):
        raise _bad(f"{where}: expected an object", where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name: expected a non-empty string", f"{where}.name")
    datatype = raw.get("datatype")
    if datatype not in DATATYPES:
        raise _bad(
            f"{where}.datatype: expected one of {', '.join(DATATYPES)}, got {datatype!r}",
            f"{where}.datatype",
        )
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(f"{where}.shape: expected a list of non-negative integers", f"{where}.shape")
    data = raw.get("data")
    if not isinstance(data, list):
        raise _bad(f"{where}.data: expected a list", f"{where}.data")
    flat: list[Any] = data
    if any(isinstance(item, list) for item in data):
        flat = _flatten(data, max(len(shape), MAX_NESTING), f"{where}.data")
    expected = element_count(shape)
    if len(flat) != expected:
        raise _bad(
            f"{where}: shape {shape} holds {expected} elements, data has {len(flat)}",
            f"{where}.data",
        )
    values = _fast_check(flat, datatype)
    if values is None:  # something is off: find it, value by value
        values = [_check_value(v, datatype, f"{where}.data") for v in flat]
    parameters = raw.get("parameters") or {}
    if not isinstance(parameters, Mapping):
        raise _bad(f"{where}.parameters: expected an object", f"{where}.parameters")
    return Tensor(name, datatype, tuple(shape), values, dict(parameters))


def to_raw(tensor: Tensor) -> bytes:
    """The tensor's raw contents: little-endian, BYTES as 4-byte length prefixes."""
    if tensor.raw is not None:
        return tensor.raw
    if tensor.datatype == "BYTES":
        parts = []
        for value in tensor.data:
            item = value if isinstance(value, bytes) else str(value).encode()
            parts.append(struct.pack("<I", len(item)))
            parts.append(item)
        return b"".join(parts)
    return struct.pack(f"<{len(tensor.data)}{FORMATS[tensor.datatype]}", *tensor.data)


def check_raw(datatype: str, shape: Sequence[int], raw: bytes) -> None:
    """`errors.Failed` when fixed-size raw contents do not fit their datatype and shape."""
    letter = FORMATS.get(datatype)
    if letter is None:
        raise errors.Failed(f"The worker sent an unknown datatype {datatype!r}.")
    if len(raw) != element_count(shape) * struct.calcsize(letter):
        raise errors.Failed(f"The worker sent {datatype} contents that do not match their shape.")


def from_raw(datatype: str, shape: Sequence[int], raw: bytes) -> list[Any]:
    """Values from raw contents; `errors.Failed` when they do not fit the shape."""
    count = element_count(shape)
    if datatype == "BYTES":
        values: list[Any] = []
        offset = 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                break
            (length,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            values.append(raw[offset : offset + length])
            offset += length
        if offset != len(raw) or len(values) != count:
            raise errors.Failed("The worker sent BYTES contents that do not match their shape.")
        return values
    letter = FORMATS.get(datatype)
    if letter is None:
        raise errors.Failed(f"The worker sent an unknown datatype {datatype!r}.")
    if len(raw) != count * struct.calcsize(letter):
        raise errors.Failed(f"The worker sent {datatype} contents that do not match their shape.")
    return list(struct.unpack(f"<{count}{letter}", raw))


def tensor_from_binary(raw: Any, binary: bytes, where: str) -> Tensor:
    """One input of the binary extension: its JSON header `raw` (no `data`) and its bytes,
    checked against its datatype and shape; `errors.Invalid` says what is wrong."""
    header = dict(raw)
    header["data"] = []
    header["shape"] = raw.get("shape")
    datatype, shape = raw.get("datatype"), raw.get("shape")
    checked = tensor_from_json({**header, "shape": [0]}, where)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _bad(f"{where}.shape: expected a list of non-negative integers", f"{where}.shape")
    try:
        if datatype == "BYTES":
            values = from_raw(str(datatype), shape, binary)
        else:  # the length is the whole check; the values go on as they came
            values = []
            if len(binary) != element_count(shape) * struct.calcsize(FORMATS[str(datatype)]):
                raise errors.Failed("length")
    except errors.Failed:
        raise _bad(
            f"{where}: {len(binary)} bytes of binary data do not hold {datatype} of shape {shape}",
            f"{where}.parameters.binary_data_size",
        ) from None
    parameters = {k: v for k, v in checked.parameters.items() if k != "binary_data_size"}
    return Tensor(checked.name, checked.datatype, tuple(shape), values, parameters, binary)
