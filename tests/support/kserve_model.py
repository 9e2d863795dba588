"""A KServe v2 model server for the tests: KServe's own Python model server (PyPI `kserve`,
in its own environment, .tools/kserve) serving models this script defines, over gRPC.

Run: `.tools/kserve/bin/python -P tests/support/kserve_model.py GRPC_PORT HTTP_PORT`.
  echo   every input back as an output of the same name, datatype and shape
  slow   `x` (FP32) back after `x`'s first value in seconds: a call to kill or leave midway
"""

import asyncio
import sys

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer

SHAPE = [-1]
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
DATATYPES += ("FP16", "FP32", "FP64", "BYTES")


def _tensor(name: str, datatype: str) -> dict:
    return {"name": name, "datatype": datatype, "shape": SHAPE}


class Echo(Model):
    def __init__(self) -> None:
        super().__init__("echo")
        self.ready = True

    def get_input_types(self) -> list[dict]:
        return [_tensor(f"in_{d.lower()}", d) for d in DATATYPES]

    def get_output_types(self) -> list[dict]:
        return [_tensor(f"in_{d.lower()}", d) for d in DATATYPES]

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        outputs = []
        for tensor in payload.inputs:
            out = InferOutput(tensor.name, list(tensor.shape), tensor.datatype)
            out.set_data_from_numpy(tensor.as_numpy(), binary_data=True)
            outputs.append(out)
        return InferResponse(payload.id, self.name, outputs)


class Slow(Model):
    def __init__(self) -> None:
        super().__init__("slow")
        self.ready = True

    def get_input_types(self) -> list[dict]:
        return [_tensor("x", "FP32")]

    def get_output_types(self) -> list[dict]:
        return [_tensor("x", "FP32")]

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        x = payload.inputs[0].as_numpy()
        await asyncio.sleep(float(x.reshape(-1)[0]))
        out = InferOutput("x", list(x.shape), "FP32")
        out.set_data_from_numpy(x, binary_data=True)
        return InferResponse(payload.id, self.name, [out])


if __name__ == "__main__":
    grpc_port, http_port = int(sys.argv[1]), int(sys.argv[2])
    ModelServer(grpc_port=grpc_port, http_port=http_port, enable_grpc=True, workers=1).start(
        [Echo(), Slow()]
    )
