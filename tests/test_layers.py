"""The architecture, checked: each layer imports only the layers below it, no
import cycle exists, and the worker SDK and the protocol stand alone.

The map (docs/development/layout.md) in code: a module of a layer may import its own
layer and any layer of a lower rank; `ALONE` layers import only themselves and
what they list. Imports under `if TYPE_CHECKING:` count for the layering (they
are dependencies of the code's meaning) but not for cycles (they never run).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gateway"

#: Layer → rank; a module may import layers of a lower rank and its own.
RANK = {
    "config": 0,
    "log_setup": 0,
    "protocol": 0,
    "telemetry": 1,
    "tokenization": 1,
    "upstreams": 2,
    "fleet": 3,
    "teams": 4,
    "admission": 5,
    "edge": 6,
    "lifecycle": 7,
    "cli": 8,
    "__main__": 9,
    # the worker SDK sits on the protocol alone (see ALONE)
    "worker": 1,
    "bench": 1,
}
#: Layers that may import nothing of the gateway but themselves and these.
ALONE = {
    "config": set(),
    "log_setup": set(),
    "protocol": set(),
    "worker": {"protocol"},
    "tokenization": {"protocol"},
    "bench": {"protocol"},
}
#: What importing the worker SDK or the protocol must not load.
SERVER_ONLY = ("starlette", "uvicorn", "httpx", "redis", "prometheus_client", "yaml")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether it runs) for every gateway import in the file."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, runs: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:
                    visit_stmt(stmt, False)
                for stmt in child.orelse:
                    visit_stmt(stmt, runs)
                continue
            visit_stmt(child, runs)

    def visit_stmt(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, runs) for a in node.names if a.name.startswith("gateway"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("gateway"):
                # `from gateway.x import y` may name a submodule y
                for alias in node.names:
                    found.append((f"{node.module}.{alias.name}", runs))
        else:
            visit(node, runs)

    visit(ast.parse(path.read_text()), True)
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted import name lands on (`gateway.a.B` → `gateway.a`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gateway"


def _graph() -> dict[str, list[tuple[str, bool]]]:
    modules = _modules()
    graph: dict[str, list[tuple[str, bool]]] = {}
    for module, path in modules.items():
        edges = []
        for name, runs in _imports(path):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.append((target, runs))
        graph[module] = edges
    return graph


def test_every_module_belongs_to_a_known_layer():
    unknown = {_layer(m) for m in _modules()} - set(RANK) - {"gateway"}
    assert not unknown, f"layers missing from the map: {sorted(unknown)}"


def test_no_layer_imports_a_higher_one():
    wrong = []
    for module, edges in _graph().items():
        here = _layer(module)
        for target, _ in edges:
            there = _layer(target)
            if there in (here, "gateway"):
                continue
            allowed = there in ALONE[here] if here in ALONE else RANK[there] < RANK[here]
            if not allowed:
                wrong.append(f"{module} ({here}) imports {target} ({there})")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = {m: [t for t, runs in edges if runs] for m, edges in _graph().items()}
    # a package's __init__ importing its own submodules is how packages work;
    # a submodule importing its package back, or modules importing each other, is a cycle
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in graph.get(module, ()):
            if module.startswith(target + "."):
                continue  # a submodule importing a name its package re-exports is fine
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    "modules",
    [
        "gateway.worker, gateway.worker.demo, gateway.worker.servicer",
        "gateway.protocol.convert, gateway.protocol.status, gateway.protocol.tls",
    ],
)
def test_the_worker_sdk_and_the_protocol_load_nothing_of_the_server(modules):
    code = (
        f"import sys; import {modules}; "
        f"print(','.join(m for m in {SERVER_ONLY!r} if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    assert loaded == "", f"importing {modules} loaded {loaded}"


def test_the_docs_map_names_every_layer_of_the_tree():
    section = (ROOT / "docs" / "development" / "layout.md").read_text()
    named = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            named.update(part.strip(" `/") for part in first.split(","))
    tree = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if not path.name.startswith("_") or path.name == "__main__.py"
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())
    }
    named = {name.removesuffix(".py") for name in named}
    assert named == tree, f"docs map vs tree: missing {tree - named}, stale {named - tree}"


def _index_names(package: Path) -> set[str]:
    """The modules and subpackages of `package` (generated stubs left out)."""
    return {
        path.stem if path.is_file() else path.name
        for path in package.iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists())
        if not path.stem.endswith(("_pb2", "_pb2_grpc"))
    }


@pytest.mark.parametrize(
    "package",
    sorted(path.parent for path in PACKAGE.rglob("__init__.py") if path.parent != PACKAGE),
    ids=lambda path: ".".join(path.relative_to(ROOT).parts),
)
def test_every_module_is_listed_in_its_package_index(package: Path):
    """A package's docstring is its index: where a newcomer looks first for what is in it
    (the top package's index is the docs' map, checked above)."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    unlisted = {
        name
        for name in _index_names(package)
        if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", docstring)
    }
    assert not unlisted, f"{package.name}/__init__.py's docstring does not name {sorted(unlisted)}"
