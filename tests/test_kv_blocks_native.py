"""The C functions that name KV blocks (`gateway/protocol/_kv_blocks.c`) are kv_blocks'
Python functions to the bit: a replica built without a compiler, which names blocks in
Python, and one built with it must route alike. Side by side on random prompts, on every
kind of token sequence the gateway passes (the text fallback's bytes, a tokenizer's list,
an event's tuple, a protobuf's repeated field), on edge values, and on hostile input."""

from __future__ import annotations

import random

import pytest

from gateway.protocol import kv_blocks

native = pytest.importorskip(
    "gateway.protocol._kv_blocks", reason="the package was built without a C compiler"
)

EDGES = [0, 1, -1, -2, 2**30 - 1, 2**30, -(2**30), 2**61 - 2, 2**61 - 1, 2**61, 2**63 - 1]
EDGES += [-(2**63), 2**64 + 5, -(2**70), 10**30]


def _tokens(rng: random.Random, kind: str, length: int) -> object:
    if kind == "bytes":
        return rng.randbytes(length)
    if kind == "edges":
        return [rng.choice(EDGES) for _ in range(length)]
    ids = [rng.randrange(200_000) for _ in range(length)]
    return tuple(ids) if kind == "tuple" else range(length) if kind == "range" else ids


@pytest.mark.parametrize("kind", ["bytes", "list", "tuple", "range", "edges"])
def test_chain_names_blocks_as_the_python_function(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(200):
        size = rng.choice([1, 2, 3, 5, 16, 64])
        tokens = _tokens(rng, kind, rng.randrange(0, 12 * size))
        parent = rng.choice([0, rng.randrange(-(2**63), 2**63), *EDGES[:11]])
        assert native.chain(tokens, size, parent) == kv_blocks._chain(tokens, size, parent)
        assert native.chain(tokens, size) == kv_blocks._chain(tokens, size)


def _holders(rng: random.Random, names: list[int]) -> dict[int, int]:
    """Workers holding prefixes of the chain, as `KvIndex` shares their bits: each of a
    few workers holds the chain up to its own depth, some of them with gaps."""
    holders: dict[int, int] = {}
    shared: dict[int, int] = {}
    for slot in range(rng.randrange(0, 6)):
        depth = rng.randrange(0, len(names) + 1)
        for name in names[:depth]:
            if rng.random() < 0.05:
                continue  # a block the worker evicted before its children
            bits = holders.get(name, 0) | 1 << (slot * 37)
            holders[name] = shared.setdefault(bits, bits)
    return holders


@pytest.mark.parametrize("kind", ["bytes", "list", "tuple", "edges"])
def test_walk_finds_the_holders_as_the_python_function(kind: str) -> None:
    rng = random.Random(kind)
    for _ in range(300):
        size = rng.choice([1, 3, 16])
        tokens = _tokens(rng, kind, rng.randrange(0, 40 * size))
        holders = _holders(rng, kv_blocks._chain(tokens, size))
        assert native.walk(tokens, size, holders) == kv_blocks._walk(tokens, size, holders)


def test_bad_input_raises_as_python_would() -> None:
    unhashable = [1, [2], 3, 4]
    hashable = [1.5, "x", None, 3]  # not ids, but named alike
    assert native.chain(hashable, 2) == kv_blocks._chain(hashable, 2)
    for function in (native.chain, kv_blocks._chain):
        with pytest.raises(TypeError):
            function(unhashable, 2)
    with pytest.raises(TypeError):
        native.walk(unhashable, 2, {})
    with pytest.raises(TypeError):
        native.chain(42, 2)  # not a sequence
    with pytest.raises(ValueError):
        native.chain(b"abcd", 0)
    with pytest.raises(TypeError):
        native.walk(b"abcd", 2, [])  # holders must be a dict
    with pytest.raises(OverflowError):
        native.chain(b"abcd", 2, 2**64)


class _Shrinking:
    """A token whose hash empties the list it is in (hostile, or a bug): the C walk
    must not read the list's freed items."""

    def __init__(self, tokens: list[object]) -> None:
        self.tokens = tokens

    def __hash__(self) -> int:
        self.tokens.clear()
        return 7


def test_a_list_changed_while_hashed_is_refused_not_read() -> None:
    for function in (native.chain, native.walk):
        tokens: list[object] = list(range(64))
        tokens[3] = _Shrinking(tokens)
        args = (tokens, 16, {}) if function is native.walk else (tokens, 16)
        with pytest.raises(RuntimeError, match="changed size"):
            function(*args)


def test_the_index_uses_the_c_functions() -> None:
    from gateway.fleet import kv_index

    assert kv_index.walk is native.walk
    assert kv_index.chain is native.chain
