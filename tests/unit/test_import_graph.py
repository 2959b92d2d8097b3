"""No import cycle between the package's modules.

Every `import` of a sandboxer module counts, at the top of a module or inside a function (a lazy
import is still a dependency); only those under `if TYPE_CHECKING:` (annotations) do not. The
layers go one way: front ends → commands → pure core → backends and edges (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sandboxer"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sandboxer"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                named.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names if alias.name.startswith("sandboxer"))
    return {name for name in named if name in known and name != "sandboxer"}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    known = _modules()
    graph = {name: _imports(path, known) for name, path in known.items()}
    assert "sandboxer.commands.create" in graph["sandboxer.api.broker"], "the graph sees lazy imports"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_code_outside_the_backends_names_a_backend() -> None:
    """A backend's name becomes code only in sandboxer/backends/ (`Backends`): no
    comparison, `match` or table elsewhere names "bwrap" or "docker" — except core/plan.py, which
    defines the names and which extension runs on which."""
    allowed = {"sandboxer.core.plan"}
    found = []
    for name, path in sorted(_modules().items()):
        if name.startswith("sandboxer.backends") or name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in ("bwrap", "docker"):
                found.append(f"{name}:{node.lineno}")
    assert found == []
