"""What a streamed answer says, read the same way by the specs: its deltas' fields in
order (`said`), and the chunks the edge wrote in the callbacks that brought them
(`noted_writes`)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.edge.http_protocol import _WriteNow


def said(
    chunks: list[Any], fields: tuple[str, ...] = ("reasoning", "content")
) -> list[tuple[str, str]]:
    """A chat stream's deltas (openai SDK chunks), in order, as (field, text), runs of a
    field joined: what it says, whatever its chunk boundaries."""
    out: list[tuple[str, str]] = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            for field in fields:
                text = delta.get(field)
                if text and out and out[-1][0] == field:
                    out[-1] = (field, out[-1][1] + text)
                elif text:
                    out.append((field, text))
    return out


def noted_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The body chunks the edge writes outside a request's task (`_WriteNow`), from now
    on, in order."""
    written: list[bytes] = []
    write = _WriteNow.write

    def noted(self: _WriteNow, body: bytes) -> None:
        write(self, body)
        written.append(body)

    monkeypatch.setattr(_WriteNow, "write", noted)
    return written
