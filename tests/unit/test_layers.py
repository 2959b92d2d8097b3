"""The layers import only downwards (docs/architecture.md): core/ is pure and imports neither the
host's edges nor the engines nor what orchestrates them; host/ never calls up into a backend or a
command; a backend never opens the registry (commands write it) nor calls a command.

Every import counts, those under TYPE_CHECKING and inside functions too: each module's source is
parsed, not imported, so a lazy import cannot hide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sandboxer"

# The embedded API's modules: the top of the stack, above the commands.
EMBEDDED_API = ("sandboxer.api.broker", "sandboxer.api.sandbox", "sandboxer.api.owner")

# layer (a subpackage) -> modules it must never import (a name and everything below it)
FORBIDDEN = {
    "core": (
        "sandboxer.host",
        "sandboxer.backends",
        "sandboxer.commands",
        "sandboxer.service",
        "sandboxer.cli",
        *EMBEDDED_API,
    ),
    "host": (
        "sandboxer.backends",
        "sandboxer.commands",
        "sandboxer.service",
        "sandboxer.cli",
        *EMBEDDED_API,
    ),
    "backends": (
        "sandboxer.host.registry",
        "sandboxer.commands",
        "sandboxer.service",
        "sandboxer.cli",
        *EMBEDDED_API,
    ),
}


def imported(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, `from a import b` counted as both a and a.b."""
    module = ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(layer: str, package_dir: Path = PACKAGE) -> list[str]:
    """Every forbidden import of the layer's modules, as `file:line: module`."""
    banned = FORBIDDEN[layer]
    found = []
    for path in sorted((package_dir / layer).rglob("*.py")):
        for line, name in imported(path, package_dir):
            if any(name == ban or name.startswith(ban + ".") for ban in banned):
                found.append(f"{path.relative_to(package_dir.parent)}:{line}: {name}")
    return found


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str) -> None:
    assert violations(layer) == []


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    """The parser is not blind: each way of writing an import is seen, in a package of its own."""
    package_dir = tmp_path / "sandboxer"
    (package_dir / "core" / "manifest").mkdir(parents=True)
    (package_dir / "core" / "manifest" / "probe.py").write_text(
        "import sandboxer.host.procs\n"
        "from sandboxer import backends\n"
        "def f():\n    from sandboxer.host.registry import Registry\n"
        "from ...commands import destroy\n"
        "from sandboxer.core.plan import Plan\n"
    )
    found = violations("core", package_dir)
    assert [line.split(": ", 1)[1] for line in found] == [
        "sandboxer.host.procs",
        "sandboxer.backends",
        "sandboxer.commands",
        "sandboxer.commands.destroy",
        "sandboxer.host.registry",
        "sandboxer.host.registry.Registry",
    ]
