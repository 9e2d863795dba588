"""An ONNX model through onnxruntime (the `tensor` extra): its inputs and outputs as the KServe
v2 protocol names them, and one run per request in a thread, so the event loop stays free.

onnxruntime runs concurrent `run` calls on one session safely; each request costs a thread
from the loop's default executor and a copy of its tensors into numpy arrays.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

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


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]


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
        self, inputs: dict[str, np.ndarray], outputs: list[str]
    ) -> list[tuple[str, np.ndarray]]:
        """The outputs asked for (all when none is), by name, in the model's order."""
        names = outputs or [o.name for o in self.outputs]
        results = await asyncio.to_thread(self.session.run, names, inputs)
        return [(name, np.asarray(value)) for name, value in zip(names, results, strict=True)]
