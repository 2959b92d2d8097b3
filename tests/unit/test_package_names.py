"""The package's public names are imported on first use (sandboxer/__init__.py) and declared for
type checkers in sandboxer/__init__.pyi: the two say the same."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import sandboxer

STUB = Path(sandboxer.__file__).with_suffix(".pyi")


def _declared() -> dict[str, str]:
    """Each name the stub imports, with the module it names."""
    found = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert alias.asname == alias.name, f"{alias.name}: a stub re-exports a name as itself"
                found[alias.name] = str(node.module)
    return found


def _stub_all() -> list[str]:
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("the stub has no __all__")


def test_the_stub_declares_exactly_the_public_names() -> None:
    assert sorted(_declared()) == sorted(sandboxer.__all__)
    assert _stub_all() == sandboxer.__all__


@pytest.mark.parametrize("name", sandboxer.__all__)
def test_each_name_is_the_object_the_stub_says(name: str) -> None:
    module = importlib.import_module(_declared()[name])
    assert getattr(sandboxer, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Brokr'"):
        _ = sandboxer.Brokr  # type: ignore[attr-defined]
