"""A KServe v2 inference on our side of the wire: the request (checked tensors, the outputs
asked for), its result, and a model's declared inputs and outputs, with their JSON for the
/v2 routes. The edge builds and answers them, the fleet passes them on, and the KServe
upstream (`gateway.upstreams.kserve_grpc`) turns them into protobuf and back; so they sit
here, below all three, as `types.py`'s generation types do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.tensors import Tensor


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output a model declares; -1 in `shape` is a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": self.platform,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
        }


@dataclass(slots=True)
class InferRequest:
    """One inference, checked: inputs flat and typed, the outputs asked for (empty: all)."""

    model: str
    version: str
    inputs: list[Tensor]
    outputs: list[str] = field(default_factory=list)
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferResult:
    model: str
    version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_name": self.model}
        if self.version:
            out["model_version"] = self.version
        if self.id:
            out["id"] = self.id
        if self.parameters:
            out["parameters"] = self.parameters
        out["outputs"] = [t.to_json() for t in self.outputs]
        return out
