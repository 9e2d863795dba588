"""The benchmark pictures of the docs, drawn with matplotlib from the result tables of
docs/benchmarks.md, so a picture always shows the figures of the table beside it (and the date
and command the table names); rerun this after replacing a table with a new run's.

    .venv/bin/python benchmarks/plots.py     # writes docs/images/bench-*.png

Reading the committed tables, not rerunning the benchmarks: a run takes minutes and its figures
move with the machine's load, and the page keeps one run's figures per table.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
IMAGES = ROOT / "docs" / "images"

Table = list[dict[str, str]]


def tables(text: str) -> list[Table]:
    """Every markdown table of `text`, as rows keyed by the header's cells."""
    found: list[Table] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.fullmatch(r"\|[\s:|-]+\|", lines[i + 1].strip()):
            header = _cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]), strict=False)))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def number(cell: str) -> float:
    """The first number of a cell: `+0.28 ms` → 0.28, `185,995` → 185995, `8.2x` → 8.2."""
    match = re.search(r"[-+]?\d[\d,]*(?:\.\d+)?", cell)
    if match is None:
        raise ValueError(f"no number in {cell!r}")
    return float(match.group().replace(",", ""))


def table_with(all_tables: list[Table], column: str) -> Table:
    """The first table that has `column`."""
    for table in all_tables:
        if table and column in table[0]:
            return table
    raise LookupError(f"{PAGE.name}: no table with a column {column!r}")


def plot_peers(all_tables: list[Table], path: Path) -> None:
    """The HTTP-mode side by side: tokens/s at 32 streams ÷ direct, added TTFT at 1 stream,
    CPU per token, one bar per gateway."""
    table = [
        row
        for row in table_with(all_tables, "gateway (HTTP upstream mode)")
        if row["/ direct"] != "-"
    ]
    names = [row["gateway (HTTP upstream mode)"] for row in table]
    panels = (
        ("tokens/s at 32 streams ÷ direct (higher is better)", "/ direct", ""),
        ("added TTFT p50 at 1 stream (lower is better)", "added TTFT p50, 1 stream", " ms"),
        ("CPU per token (lower is better)", "CPU per token", " µs"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    colors = ["#9e9e9e" if "furnace" not in name else "#e65100" for name in names]
    for ax, (title, column, unit) in zip(axes, panels, strict=True):
        values = [number(row[column]) for row in table]
        bars = ax.barh(names, values, color=colors)
        ax.bar_label(bars, labels=[f"{v:g}{unit}" for v in values], padding=3, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.invert_yaxis()
        ax.margins(x=0.25)
        ax.tick_params(labelsize=8)
    fig.suptitle("furnace-gateway and the Rust routers, one run (make bench-peers)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overload(all_tables: list[Table], path: Path) -> None:
    """Goodput against offered load, the queue off and on."""
    table = table_with(all_tables, "goodput (req/s)")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for queue, style in (("off", "o--"), ("on", "s-")):
        rows = [row for row in table if row["queue"] == queue]
        ax.plot(
            [number(row["offered load"]) for row in rows],
            [number(row["goodput (req/s)"]) for row in rows],
            style,
            label=f"queue {queue}",
        )
    ax.axhline(20, color="#9e9e9e", linewidth=0.8, linestyle=":")
    ax.annotate("capacity: 20 req/s", (2.3, 19.0), fontsize=8, color="#616161")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("goodput: answered within 2 s (req/s)")
    ax.set_ylim(0, 24)
    ax.legend()
    ax.set_title("Overload (bench_overload): goodput with the queue off and on", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    all_tables = tables(PAGE.read_text())
    IMAGES.mkdir(exist_ok=True)
    plot_peers(all_tables, IMAGES / "bench-peers.png")
    plot_overload(all_tables, IMAGES / "bench-overload.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
