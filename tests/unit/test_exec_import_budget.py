"""The exec hot path's import budget: what `sandboxer exec` loads before the command runs.

The exec path below the CLI (each backend's entry: sandboxer.backends.bwrap.enter with its
joiner, sandboxer.backends.docker.enter with the Engine client, and the record they read) avoids
modules that cost milliseconds at every exec (`signal` and `enum`, `typing`, `collections`, `re`, `json`,
`dataclasses`): this test fails when one comes back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HEAVY = {"enum", "signal", "typing", "collections", "re", "json", "dataclasses", "subprocess", "pathlib"}
BUDGET = {
    "sandboxer.backends.bwrap.enter": HEAVY,
    "sandboxer.backends.bwrap.joiner": HEAVY,
    "sandboxer.backends.docker.enter": HEAVY - {"collections"},  # threading (the stdin pump) brings it
    "sandboxer.core.record_exec": HEAVY,
}


@pytest.mark.parametrize("module", sorted(BUDGET))
def test_the_exec_path_loads_no_heavy_module(module: str) -> None:
    code = f"import sys\nbefore = set(sys.modules)\nimport {module}\nprint(*sorted(set(sys.modules) - before))"
    # No site (its own imports would hide ours); the package from the checkout.
    loaded = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    new = loaded.stdout.split()
    assert module in new
    assert [name for name in new if name in BUDGET[module]] == []


@pytest.mark.parametrize(
    "module", ["sandboxer.backends.bwrap.backend", "sandboxer.backends.docker.backend", "sandboxer.commands.teardown"]
)
def test_teardown_list_and_gc_load_no_namespace_code_or_yaml(module: str) -> None:
    """teardown, list and gc reach a backend for is_running, stop and release only: neither the
    namespace code nor the config parser (which brings YAML) loads with it. (The typed record
    brings the plan's types, sandboxer.core.plan, which imports no YAML.)"""
    code = f"import sys\nimport {module}\nprint(*sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    bwrap = {"sandboxer.backends.bwrap.namespace", "sandboxer.backends.bwrap.live"}
    heavy = {"sandboxer.core.config", "sandboxer.core.yamlstrict", *bwrap, "ruamel.yaml"}
    assert heavy & set(loaded.stdout.split()) == set()
