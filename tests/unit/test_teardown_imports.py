"""teardown, list and gc stay light: they load no namespace code and no config parser (the
modules of each layer import only what their job needs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module", ["sandboxer.backends.bwrap.backend", "sandboxer.backends.docker.backend", "sandboxer.commands.teardown"]
)
def test_teardown_list_and_gc_load_no_namespace_code_or_yaml(module: str) -> None:
    """teardown, list and gc reach a backend for is_running, stop and release only: neither the
    namespace code nor the config parser (which brings YAML) loads with it. (The typed record
    brings the plan's types, sandboxer.core.plan, which imports no YAML.)"""
    code = f"import sys\nimport {module}\nprint(*sorted(sys.modules))"
    # With site-packages: the receipts and reports teardown, list and gc return are the result
    # types (sandboxer.api.results, on pydantic), which every front end has loaded anyway.
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    bwrap = {"sandboxer.backends.bwrap.namespace", "sandboxer.backends.bwrap.live"}
    heavy = {"sandboxer.core.config", "sandboxer.core.yamlstrict", *bwrap, "ruamel.yaml"}
    assert heavy & set(loaded.stdout.split()) == set()
