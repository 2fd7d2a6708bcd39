"""The package's layers, read from its import graph: data flows one way
(layout -> planning -> engine -> transport), pure layers import no I/O, and no module
imports itself back through a cycle."""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "src" / "kvxfer"

# what each pure layer may import from the package (besides itself)
PURE_ALLOWED = {
    "kvxfer.layout": {"kvxfer.errors", "kvxfer._intmath"},
    "kvxfer.planning": {"kvxfer.errors", "kvxfer._intmath", "kvxfer.layout"},
    "kvxfer.wire": {"kvxfer.errors", "kvxfer._intmath", "kvxfer.layout"},
}
IO_LIBS = {"nixl_cu12", "nixl", "zmq"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path, *, top_level_only: bool) -> set[str]:
    """Absolute names imported by a module (relative imports resolved).

    ``top_level_only``: skip imports inside functions (deliberate lazy imports), but keep
    ``if TYPE_CHECKING:`` blocks, which still make a cycle for a reader.
    """
    tree = ast.parse(path.read_text())
    me = _module_name(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    nodes: list[ast.AST] = list(tree.body) if top_level_only else list(ast.walk(tree))
    while nodes:
        node = nodes.pop()
        if top_level_only and isinstance(node, ast.If | ast.Try):
            nodes.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _layer(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


@pytest.mark.parametrize("layer", sorted(PURE_ALLOWED))
def test_pure_layers_import_no_io(layer: str) -> None:
    bad = []
    for mod, path in MODULES.items():
        if _layer(mod) != layer:
            continue
        for name in _imports(path, top_level_only=False):
            root = name.split(".")[0]
            if root in IO_LIBS:
                bad.append(f"{mod} imports {name}")
            elif root == "kvxfer" and name != "kvxfer":
                target = _layer(name)
                if target != layer and target not in PURE_ALLOWED[layer]:
                    bad.append(f"{mod} imports {name}")
    assert bad == []


def test_only_transport_imports_nixl_and_zmq() -> None:
    bad = [
        f"{mod} imports {name}"
        for mod, path in MODULES.items()
        if _layer(mod) != "kvxfer.transport"
        for name in _imports(path, top_level_only=False)
        if name.split(".")[0] in IO_LIBS
    ]
    assert bad == []


def test_transport_does_not_import_engine() -> None:
    bad = [
        f"{mod} imports {name}"
        for mod, path in MODULES.items()
        if _layer(mod) == "kvxfer.transport"
        for name in _imports(path, top_level_only=False)
        if _layer(name) in {"kvxfer.engine", "kvxfer.cli", "kvxfer.bench", "kvxfer.integrations"}
    ]
    assert bad == []


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        deps = set()
        for name in _imports(path, top_level_only=True):
            # `from kvxfer.x import y` names module kvxfer.x.y when that is a module
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            # a package's __init__ is imported by its submodules: not an edge back
            if name and name != mod and not mod.startswith(name + "."):
                deps.add(name)
        graph[mod] = deps
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert cycles == []


def test_the_graph_reader_sees_imports() -> None:
    # guards the test itself: a reader that saw nothing would pass every check above
    graph = _graph()
    assert "kvxfer.planning.pairing" in graph["kvxfer.engine.consumer"]
    assert "kvxfer.layout.model" in graph["kvxfer.planning.descriptors"]
