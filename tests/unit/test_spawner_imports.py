"""The service's spawner process forks every exec's relay, and each fork pays for what the
process has loaded: its page tables, and the at-fork handlers of threading and logging, which
run in every child. So the spawner process loads joiner and a little of the standard library,
never those (backends/bwrap/spawner_process.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Modules with at-fork handlers or a large import graph of their own.
FORBIDDEN = {"threading", "logging", "random", "subprocess", "dataclasses", "inspect", "tempfile", "pathlib"}


def _loaded_by(module: str) -> set[str]:
    # As the service starts it (spawner.py): isolated, the package's place put first on the path.
    code = (
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nbefore = set(sys.modules)\n"
        f"import {module}\nprint(*sorted(set(sys.modules) - before))"
    )
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    return set(done.stdout.split())


def test_the_spawner_process_loads_nothing_with_fork_handlers() -> None:
    loaded = _loaded_by("sandboxer.backends.bwrap.spawner_process")
    assert "sandboxer.backends.bwrap.joiner" in loaded
    assert {name.split(".")[0] for name in loaded} & FORBIDDEN == set()


def test_the_spawner_process_loads_no_third_party_module() -> None:
    loaded = _loaded_by("sandboxer.backends.bwrap.spawner_process")
    standard = set(sys.stdlib_module_names)
    assert sorted(name for name in loaded if name.split(".")[0] not in standard | {"sandboxer"}) == []
