"""What the tensor worker's servicer needs of an engine: a model's name, its inputs and
outputs, and one inference over raw tensors (datatype, shape, little-endian bytes), which each
engine decodes its own way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: One tensor as it travels: (datatype, shape, raw little-endian contents).
RawTensor = tuple[str, tuple[int, ...], bytes]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One input or output; -1 in `shape` is a variable dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]


class TensorEngine(Protocol):
    name: str
    platform: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    async def infer(
        self, inputs: dict[str, RawTensor], outputs: list[str]
    ) -> list[tuple[str, RawTensor]]:
        """The outputs asked for (all when none is), by name; `errors.Invalid` for bad input."""
        ...
