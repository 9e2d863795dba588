"""Writes the worker protocol's reference page (docs/reference/worker-protocol.md) from the
commented `.proto`, so the page says what the contract says and cannot drift from it: every
rpc, message, field and enum value with its own comment, in the file's order.

    .venv/bin/python protos/document.py          # rewrites the page
    .venv/bin/python protos/document.py --check  # exits 1 when the page is stale

The `.proto` is parsed by line, which its house style allows: one declaration a line, each
preceded by its `//` comment (tests/test_protos.py checks that every rpc and field has one), no
nested messages. A script beside protos/generate.py, not a module of the package: it writes a
file of the repository.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "furnace" / "engine" / "v1" / "engine.proto"
PAGE = ROOT / "docs" / "reference" / "worker-protocol.md"

_RPC = re.compile(r"rpc (\w+)\((stream )?(\w+)\) returns \((stream )?(\w+)\);")
_FIELD = re.compile(r"(optional |repeated )?([\w.<>, ]+?) (\w+) = (\d+);")
_VALUE = re.compile(r"(\w+) = (\d+);")
_BLOCK = re.compile(r"(service|message|enum|oneof) (\w+) \{(\})?")


@dataclass
class Block:
    """A service, message or enum: its comment and its rows (name, type, number, comment)."""

    kind: str
    name: str
    comment: str
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)


def parse(text: str) -> tuple[str, list[Block]]:
    """The file's header comment and its blocks, in order."""
    lines = [line.strip() for line in text.splitlines()]
    header: list[str] = []
    for line in lines:
        if not line.startswith("//"):
            break
        header.append(line.removeprefix("//").strip())
    blocks: list[Block] = []
    comment: list[str] = []
    oneof: str | None = None
    for line in lines[len(header) :]:
        if line.startswith("//"):
            comment.append(line.removeprefix("//").strip())
            continue
        said = " ".join(comment)
        if not line:
            comment = []  # a comment a blank line ends speaks of the section, not a declaration
            continue
        comment = []
        if match := _BLOCK.fullmatch(line):
            kind, name, _ = match.groups()
            if kind == "oneof":
                oneof = name
            else:
                blocks.append(Block(kind, name, said))
        elif line == "}":
            oneof = None
        elif match := _RPC.fullmatch(line):
            name, stream_in, request, stream_out, response = match.groups()
            into = f"{'stream ' if stream_in else ''}{request}"
            out = f"{'stream ' if stream_out else ''}{response}"
            signature = f"{into} → {out}"
            blocks[-1].rows.append((name, signature, "", said))
        elif blocks and blocks[-1].kind == "enum" and (match := _VALUE.fullmatch(line)):
            blocks[-1].rows.append((match.group(1), "", match.group(2), said))
        elif match := _FIELD.fullmatch(line):
            label, type_, name, number = match.groups()
            shown = f"{(label or '').strip()} {type_}".strip()
            if oneof is not None:
                shown += f" (one of `{oneof}`)"
            blocks[-1].rows.append((name, shown, number, said))
        elif line not in ('syntax = "proto3";',) and not line.startswith("package "):
            raise ValueError(f"{PROTO.name}: a line this page cannot read: {line!r}")
    return " ".join(line for line in header if line), blocks


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _type_link(text: str, names: set[str]) -> str:
    """Backquoted message and enum names become links to their sections."""
    return re.sub(
        r"\b([A-Z]\w+)\b",
        lambda m: f"[`{m.group(1)}`](#{m.group(1).lower()})" if m.group(1) in names else m.group(1),
        text,
    )


def render(text: str) -> str:
    """The page for the `.proto` `text`."""
    header, blocks = parse(text)
    names = {block.name for block in blocks}
    out = [
        "# The worker protocol",
        "",
        "<!-- Generated from protos/furnace/engine/v1/engine.proto by "
        "python protos/document.py; edit the .proto's comments, not this page. -->",
        "",
        f"`protos/furnace/engine/v1/engine.proto`, package `furnace.engine.v1`. {header}",
        "What the gateway asks of a worker and how it uses it: "
        "[Workers and upstreams](../concepts/workers-and-upstreams.md).",
    ]
    for block in blocks:
        out += ["", f"## {block.name}", ""]
        if block.comment:
            out += [f"{block.kind.capitalize()}. {block.comment}", ""]
        else:
            out += [f"{block.kind.capitalize()}.", ""]
        if not block.rows:
            out.append("No fields.")
            continue
        if block.kind == "service":
            out += ["| rpc | call | meaning |", "| --- | --- | --- |"]
            out += [
                f"| `{name}` | {_type_link(sig, names)} | {_cell(said)} |"
                for name, sig, _, said in block.rows
            ]
        elif block.kind == "enum":
            out += ["| value | number | meaning |", "| --- | --- | --- |"]
            out += [f"| `{name}` | {num} | {_cell(said)} |" for name, _, num, said in block.rows]
        else:
            out += ["| field | type | number | meaning |", "| --- | --- | --- | --- |"]
            out += [
                f"| `{name}` | {_cell(_type_link(type_, names))} | {num} | {_cell(said)} |"
                for name, type_, num, said in block.rows
            ]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    page = render(PROTO.read_text())
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python protos/document.py")
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
