"""The `sandboxer` command is a small client: every command of every caller pays for what it
imports, so it loads the standard library only, little of it, and of sandboxer only the
directories' module and the pumps that copy its terminal and files — the import budget the
service exists for. (exec -t loads the terminal module too, when it needs it.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALLOWED_OWN = {
    "sandboxer",
    "sandboxer.__main__",
    "sandboxer.clients",  # a package of no imports of its own
    "sandboxer.clients.cli",
    "sandboxer.dirs",
    "sandboxer.host",
    "sandboxer.execio",  # a package of no imports of its own
    "sandboxer.execio.pumps",
    "sandboxer.host.ready",
}
EXEC_TERMINAL = {"sandboxer.execio.terminal"}
# What the service pays for once and the client must never: the command table and its parsers,
# the HTTP server, YAML, the broker's core; and what no command it forwards needs (annotations
# are never evaluated; only the service runs threads; only exec -t touches a terminal's modes).
FORBIDDEN = {"typer", "click", "aiohttp", "ruamel", "pydantic", "rich", "http", "asyncio", "subprocess", "dataclasses"}
UNNEEDED = {"typing", "threading", "termios"}


def _loaded_by(module: str) -> list[str]:
    code = f"import sys\nbefore = set(sys.modules)\nimport {module}\nprint(*sorted(set(sys.modules) - before))"
    # No site (its own imports would hide ours); the package from the checkout.
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return done.stdout.split()


def test_the_client_loads_no_other_sandboxer_module() -> None:
    loaded = _loaded_by("sandboxer.__main__")
    assert "sandboxer.clients.cli" in loaded
    assert {name for name in loaded if name.split(".")[0] == "sandboxer"} <= ALLOWED_OWN


def test_exec_t_loads_only_the_terminal_module_more() -> None:
    loaded = _loaded_by("sandboxer.__main__, sandboxer.execio.terminal")
    own = {name for name in loaded if name.split(".")[0] == "sandboxer"}
    assert own <= ALLOWED_OWN | EXEC_TERMINAL
    assert {name.split(".")[0] for name in loaded} & FORBIDDEN == set()


def test_the_client_loads_neither_typing_nor_threading_nor_termios() -> None:
    loaded = _loaded_by("sandboxer.__main__")
    assert set(loaded) & UNNEEDED == set()


def test_the_client_loads_no_third_party_or_heavy_module() -> None:
    loaded = _loaded_by("sandboxer.__main__")
    assert {name.split(".")[0] for name in loaded} & FORBIDDEN == set()
    standard = set(sys.stdlib_module_names)
    assert [name for name in loaded if name.split(".")[0] not in standard | {"sandboxer"}] == []
