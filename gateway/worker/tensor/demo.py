"""The demo's tensor model, pure Python (no numpy, no onnxruntime), so `furnace-gateway demo`
serves a tensor model from the plain install: `furnace-demo-affine`, y = x * 2 + 1 over 1-D FP32
tensors of any length. Slow for big tensors (a Python list of the values); a demo only."""

from __future__ import annotations

from gateway.protocol import errors
from gateway.protocol.tensors import Tensor, from_raw, to_raw
from gateway.worker.tensor.engine import RawTensor, TensorInfo

DEMO_TENSOR_MODEL = "furnace-demo-affine"


class DemoTensorEngine:
    name = DEMO_TENSOR_MODEL
    platform = "furnace_demo"
    inputs: tuple[TensorInfo, ...] = (TensorInfo("x", "FP32", (-1,)),)
    outputs: tuple[TensorInfo, ...] = (TensorInfo("y", "FP32", (-1,)),)

    async def infer(
        self, inputs: dict[str, RawTensor], outputs: list[str]
    ) -> list[tuple[str, RawTensor]]:
        if set(inputs) != {"x"}:
            raise errors.Invalid("the demo model takes one input, x")
        datatype, shape, raw = inputs["x"]
        if datatype != "FP32":
            raise errors.Invalid("x is FP32")
        values = [v * 2 + 1 for v in from_raw("FP32", shape, raw)]
        return [("y", ("FP32", shape, to_raw(Tensor("y", "FP32", shape, values))))]
