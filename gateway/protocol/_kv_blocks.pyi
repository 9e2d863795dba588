"""Types of the C module `_kv_blocks.c`: `chain` and `walk` of `kv_blocks`."""

from collections.abc import Sequence

def chain(tokens: Sequence[int], block_size: int, parent: int = ...) -> list[int]: ...
def walk(
    tokens: Sequence[int], block_size: int, holders: dict[int, int]
) -> tuple[list[tuple[int, int]], int | None]: ...
