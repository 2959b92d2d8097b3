"""Shared fixtures: running the real CLI, isolated broker directories, and an environment guard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


@pytest.fixture(autouse=True)
def _no_environment_leaks() -> Iterator[None]:
    """Fail any test that leaves os.environ changed."""
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert after == before, "test leaked environment changes"


@dataclass
class Result:
    """What one CLI run returned."""

    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout parsed as JSON."""
        return json.loads(self.stdout)


@dataclass
class Broker:
    """An isolated broker: its own config and state directories, driven through the real CLI."""

    config: Path
    state: Path

    def run(self, *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None) -> Result:
        """Run `sandboxer --config-dir C --state-dir S ARGS…` as a real process."""
        argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(self.config), "--state-dir", str(self.state)]
        proc = subprocess.run(
            [*argv, *args],
            input=stdin,
            capture_output=True,
            env=env if env is not None else _child_env(),
            check=False,
            timeout=300,
        )
        return Result(proc.returncode, proc.stdout.decode(), proc.stderr.decode())

    def write(self, relpath: str, text: str) -> Path:
        """Write an owner file below the config dir."""
        path = self.config / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path


def settled(read: Callable[[], T], wanted: object, seconds: float = 10) -> T:
    """What `read()` returns once it is `wanted`, or its last answer after `seconds` (for the
    test's assert to show): for what ends a moment after the call that ends it (a reap, a
    process's exit), however loaded the machine."""
    deadline = time.monotonic() + seconds
    while (value := read()) != wanted and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _child_env() -> dict[str, str]:
    """The CLI in-process (SANDBOXER_NO_SERVICE=1): these brokers test the command table itself,
    and root's command would otherwise start a service for each state dir on demand."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    return {key: os.environ[key] for key in keep if key in os.environ} | {"SANDBOXER_NO_SERVICE": "1"}


@pytest.fixture
def broker(tmp_path: Path) -> Broker:
    """A broker with empty, owner-only config and state directories."""
    config = tmp_path / "config"
    state = tmp_path / "state"
    for directory in (config / "extensions", config / "profiles"):
        directory.mkdir(parents=True)
    config.chmod(0o700)
    return Broker(config=config, state=state)


def make_runtime(path: Path) -> Path:
    """A minimal runtime tree: what the artifact rules require and nothing more (no interpreter run)."""
    (path / "bin").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    python = path / "bin" / "python3"
    python.write_bytes(b"#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return path


GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "init.defaultBranch=main"]


def make_repository(path: Path, files: dict[str, bytes], message: str = "init") -> Path:
    """A git repository at `path` with one commit of `files` (name -> content) on main."""
    subprocess.run([*GIT, "init", "-q", str(path)], check=True)
    for name, content in files.items():
        (path / name).write_bytes(content)
    subprocess.run([*GIT, "-C", str(path), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(path), "commit", "-qm", message], check=True)
    return path
