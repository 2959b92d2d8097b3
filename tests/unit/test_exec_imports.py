"""exec stays light: every exec pays for what its path imports, so the core's exec
(sandboxer/commands/execute.py), the request it runs (sandboxer/core/exec_request.py) and each
engine's exec part (sandboxer.backends.Backends.execution: backends/*/enter.py) load neither the
command table, YAML, netlink nor HTTP, nor the engines' create-time code (the plan, the registry,
the namespace code, the full backends)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THIRD_PARTY = {"typer", "click", "ruamel", "pyroute2", "aiohttp", "psutil", "rich"}
CREATE_TIME = {
    "sandboxer.core.config",
    "sandboxer.core.plan",
    "sandboxer.core.record",
    "sandboxer.host.registry",
    "sandboxer.backends.protocol",
    "sandboxer.backends.bwrap.backend",
    "sandboxer.backends.bwrap.namespace",
    "sandboxer.backends.bwrap.live",
    "sandboxer.backends.docker.backend",
    "sandboxer.backends.docker.container",
}


def _loaded_by(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-S", "-c", f"{code}\nimport sys\nprint(*sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return set(done.stdout.split())


@pytest.mark.parametrize("backend", ["bwrap", "docker"])
def test_the_exec_path_loads_no_create_time_code(backend: str) -> None:
    loaded = _loaded_by(
        "import sandboxer.commands.execute, sandboxer.core.exec_request\n"
        f"from sandboxer.backends import Backends\nBackends().execution({backend!r})"
    )
    assert f"sandboxer.backends.{backend}.enter" in loaded
    assert {name.split(".")[0] for name in loaded} & THIRD_PARTY == set()
    assert loaded & CREATE_TIME == set()
