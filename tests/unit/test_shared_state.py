"""State the service's threads share is owned by one object, under its lock (issue 31).

The service runs creates, execs, teardowns and warm fills on many threads of one process, so a
table at module level that more than one of them changes is a race: two teardowns reaping the
same bwrap once failed one in a hundred with KeyError (backends/bwrap/stop.py). This test reads
the package's source: a module-level container (a dict, list, set, ...) that its module changes,
a `global` statement, or a mutable class attribute is allowed only where it is named below with
the reason it is safe. New shared state belongs to an object with a lock (stop.StartedBwraps,
spawner.Slot, warm.Fills, docker's container.Learnt)."""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandboxer.commands.services import Services
from sandboxer.dirs import Dirs

PACKAGE = Path(__file__).resolve().parents[2] / "sandboxer"
MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "popitem", "clear", "setdefault", "remove", "discard"}
CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}
# (module, name): why it is safe.
ALLOWED = {
    ("backends/bwrap/spawner_process.py", "_status_of"): "the spawner process runs one thread; SIGCHLD is blocked "
    "while _start adds to it",
    ("backends/bwrap/spawner_process.py", "global _own_pid_namespace"): "set once, before the first request, in a "
    "process of one thread",
    ("api/caller.py", "_CREATING"): "read and changed only under _CREATE_LOCK",
    ("api/jsonresult.py", "_ADAPTERS"): "a cache of values built whole before one assignment (the GIL makes a dict's "
    "item assignment atomic); two threads building the same one each get a whole one",
}


def _is_container(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in CONTAINER_CALLS
    return False


def _targets(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign) and _is_container(node.value):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and _is_container(node.value) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _changed(tree: ast.Module, name: str) -> bool:
    """Whether a function of the module changes the container `name` (at run time, not at import)."""
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in (inner for function in functions for inner in ast.walk(function)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            changed = node.value
        elif isinstance(node, ast.AugAssign):
            changed = node.target
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            changed = node.func.value
        else:
            continue
        if isinstance(changed, ast.Name) and changed.id == name:
            return True
    return False


def shared_state() -> set[tuple[str, str]]:
    """Every module-level container its module changes, every `global`, every mutable class
    attribute in the package: (module, name)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(PACKAGE))
        tree = ast.parse(path.read_text())
        for node in tree.body:
            found |= {(module, name) for name in _targets(node) if _changed(tree, name)}
            if isinstance(node, ast.ClassDef):
                found |= {(module, f"{node.name}.{name}") for item in node.body for name in _targets(item)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found |= {(module, f"global {name}") for name in node.names}
    return found


def test_state_the_service_threads_share_is_owned_by_an_object_with_a_lock() -> None:
    unexplained = sorted(shared_state() - set(ALLOWED))
    assert unexplained == [], "module-level state changed at run time, not owned by an object with a lock"
    assert set(ALLOWED) <= shared_state(), "an allowance no longer needed"


def test_a_fill_asked_for_while_the_service_stops_fails_nothing(tmp_path: Path) -> None:
    """A create or teardown that asks for a fill as the service stops (its fill thread shut down)
    has made or removed its sandbox already: asking must not raise (it would fail the create
    whose sandbox then runs on unknown to its caller) nor start a fill anywhere else."""
    fills = ThreadPoolExecutor(max_workers=1)
    fills.shutdown()
    services = Services.of()
    services.fills.run_on(fills)
    services.fills.spawn(Dirs(config=str(tmp_path / "config"), state=str(tmp_path / "state")), "p")
    assert not (tmp_path / "state").exists()  # no detached fill either (it would log there)
