"""An ONNX model through onnxruntime (the `tensor` extra): its inputs and outputs as the KServe
v2 protocol names them, and one run per request in a thread, so the event loop stays free.

onnxruntime runs concurrent `run` calls on one session safely; each request costs a thread
from the loop's default executor and a copy of its tensors into numpy arrays.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from gateway.protocol import errors
from gateway.worker.tensor.engine import RawTensor, TensorInfo

#: ONNX element types (as onnxruntime names them) to the protocol's datatypes.
ONNX_DATATYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
#: The protocol's datatypes to numpy's (little-endian); BYTES are object arrays.
NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}


def _info(arg: Any) -> TensorInfo:
    datatype = ONNX_DATATYPES.get(arg.type)
    if datatype is None:
        raise ValueError(f"the model's tensor {arg.name} has a type the protocol lacks: {arg.type}")
    shape = tuple(d if isinstance(d, int) else -1 for d in (arg.shape or ()))
    return TensorInfo(arg.name, datatype, shape)


class OnnxEngine:
    """One ONNX model, named `name` (default: the file's stem)."""

    platform = "onnxruntime_onnx"

    def __init__(self, path: str, name: str | None = None) -> None:
        self.name = name or Path(path).stem
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = tuple(_info(i) for i in self.session.get_inputs())
        self.outputs = tuple(_info(o) for o in self.session.get_outputs())

    async def infer(
        self, inputs: dict[str, RawTensor], outputs: list[str]
    ) -> list[tuple[str, RawTensor]]:
        """The outputs asked for (all when none is), by name, in the model's order."""
        arrays = {name: _decode(*tensor) for name, tensor in inputs.items()}
        names = outputs or [o.name for o in self.outputs]
        results = await asyncio.to_thread(self.session.run, names, arrays)
        datatypes = {o.name: o.datatype for o in self.outputs}
        out = []
        for name, value in zip(names, results, strict=True):
            array = np.asarray(value)
            datatype = datatypes[name]
            out.append((name, (datatype, tuple(array.shape), _encode(datatype, array))))
        return out


def _decode(datatype: str, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """A numpy view over the raw contents (BYTES: an object array of str, as onnxruntime
    takes its string tensors)."""
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        items: list[str] = []
        offset = 0
        while offset + 4 <= len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            items.append(raw[offset + 4 : offset + 4 + length].decode(errors="replace"))
            offset += 4 + length
        if offset != len(raw) or len(items) != count:
            raise errors.Invalid("BYTES contents do not match their shape")
        return np.array(items, dtype=object).reshape(shape)
    dtype = NUMPY_DTYPES.get(datatype)
    if dtype is None:
        raise errors.Invalid(f"unknown datatype {datatype}")
    if len(raw) != count * dtype.itemsize:
        raise errors.Invalid(f"{datatype} contents do not match their shape {list(shape)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _encode(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        parts = []
        for item in array.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)) + data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=NUMPY_DTYPES[datatype]).tobytes()
