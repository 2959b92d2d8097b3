"""`sandboxer doctor` on this host: all good here; a host without bwrap (hidden in a mount
namespace of the test's own) or with a config dir others may write is told what to do, one
line each, exit 5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO


def _doctor(*args: str, config: Path, state: Path, wrap: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "sandboxer", "--config-dir", str(config), "--state-dir", str(state), "doctor", *args]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    return subprocess.run([*(wrap or []), *argv], capture_output=True, text=True, env=env, timeout=120, check=False)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    if os.geteuid() != 0:
        pytest.skip("doctor's hidden-bwrap case needs root (a mount namespace of the test's own)")
    config, state = tmp_path / "config", tmp_path / "state"
    config.mkdir(mode=0o700)
    return config, state


def test_this_host_is_ready(dirs: tuple[Path, Path]) -> None:
    config, state = dirs
    done = _doctor(config=config, state=state)
    assert done.returncode == 0, done.stdout + done.stderr
    names = [line.split(":")[0].split(maxsplit=1) for line in done.stdout.splitlines()]
    assert [name for _, name in names][:5] == ["bwrap", "user namespaces", "landlock", "cgroups", "git"]
    assert all(status in ("ok", "warn") for status, _ in names), done.stdout
    assert all(status == "ok" for status, name in names if name not in ("docker", "approvals")), done.stdout
    assert ["warn", "approvals"] in names  # an empty config dir: nothing to create from yet
    document = json.loads(_doctor("--json", config=config, state=state).stdout)
    assert document["ok"] is True
    assert {check["name"] for check in document["checks"]} >= {"bwrap", "landlock", "config dir", "state dir"}


def test_a_host_without_bwrap_is_told_how_to_install_it(dirs: tuple[Path, Path]) -> None:
    config, state = dirs
    hidden = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'mount --bind /dev/null /usr/bin/bwrap && exec "$@"',
        "sh",
    ]
    done = _doctor(config=config, state=state, wrap=hidden)
    assert done.returncode == 5, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        "fail bwrap: not installed (looked in /usr/bin:/bin:/usr/local/bin) — apt-get install bubblewrap"
    )


def test_a_config_dir_others_may_write_is_a_failure_with_its_fix(dirs: tuple[Path, Path]) -> None:
    config, state = dirs
    config.chmod(0o777)
    done = _doctor(config=config, state=state)
    assert done.returncode == 5
    line = next(line for line in done.stdout.splitlines() if line.startswith("fail config dir"))
    assert line == f"fail config dir: {config} is writable by others (mode 777) — chmod go-w {config}"
