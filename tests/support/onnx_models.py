"""Tiny ONNX models built on the spot with the `onnx` package's helpers, for the tensor worker."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

#: The datatypes the identity model passes through, with ONNX's element type for each.
IDENTITY_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def affine_model(path: Path) -> Path:
    """y = x * 2 + 1 on FP32 tensors of shape [batch, 4]."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Add", ["x2", "one"], ["y"]),
        ],
        "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[two, one],
    )
    return _save(graph, path)


def identity_model(path: Path) -> Path:
    """`out_<type>` = `in_<type>` for each datatype of IDENTITY_TYPES, any 1-D length."""
    nodes, inputs, outputs = [], [], []
    for datatype, element in IDENTITY_TYPES.items():
        name = datatype.lower()
        nodes.append(helper.make_node("Identity", [f"in_{name}"], [f"out_{name}"]))
        inputs.append(helper.make_tensor_value_info(f"in_{name}", element, ["n"]))
        outputs.append(helper.make_tensor_value_info(f"out_{name}", element, ["n"]))
    return _save(helper.make_graph(nodes, "identity", inputs, outputs), path)
