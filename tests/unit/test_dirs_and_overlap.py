"""Directory resolution and the runtime overlap rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxer.core.runtime import check_overlap
from sandboxer.dirs import resolve_dirs, service_socket
from sandboxer.errors import PolicyError


def test_root_defaults() -> None:
    """Root's state is on disk (workspaces can be large); its service's socket is in /run."""
    dirs = resolve_dirs(config_dir=None, state_dir=None, environ={}, euid=0, home="/root")
    assert (dirs.config, dirs.state) == ("/etc/sandboxer", "/var/lib/sandboxer")
    assert service_socket(dirs, {}) == "/run/sandboxer/broker.sock"
    assert service_socket(dirs, {"SANDBOXER_SOCKET": "/tmp/s.sock"}) == "/tmp/s.sock"
    other = resolve_dirs(config_dir=None, state_dir="/srv/state", environ={}, euid=0, home="/root")
    assert service_socket(other, {}) == "/srv/state/broker.sock"


def test_user_defaults_follow_xdg() -> None:
    env = {"XDG_CONFIG_HOME": "/home/u/cfg", "XDG_RUNTIME_DIR": "/run/user/1000"}
    dirs = resolve_dirs(config_dir=None, state_dir=None, environ=env, euid=1000, home="/home/u")
    assert (dirs.config, dirs.state) == ("/home/u/cfg/sandboxer", "/run/user/1000/sandboxer")


def test_user_defaults_ignore_relative_xdg_values() -> None:
    env = {"XDG_CONFIG_HOME": "cfg", "XDG_RUNTIME_DIR": "run"}
    dirs = resolve_dirs(config_dir=None, state_dir=None, environ=env, euid=1000, home="/home/u")
    assert (dirs.config, dirs.state) == ("/home/u/.config/sandboxer", "/home/u/.local/state/sandboxer")


def test_environment_then_options_win() -> None:
    env = {"SANDBOXER_CONFIG": "/c", "SANDBOXER_STATE": "/s"}
    assert resolve_dirs(config_dir=None, state_dir=None, environ=env, euid=0, home="/").config == "/c"
    dirs = resolve_dirs(config_dir="/o/c", state_dir="/o/s", environ=env, euid=0, home="/")
    assert (dirs.config, dirs.state) == ("/o/c", "/o/s")


@pytest.mark.parametrize(("runtime", "other"), [("a", "a"), ("a/b", "a"), ("a", "a/b")])
def test_overlapping_paths_are_refused(tmp_path: Path, runtime: str, other: str) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    with pytest.raises(PolicyError, match="overlaps the state dir"):
        check_overlap(str(tmp_path / runtime), {"state dir": str(tmp_path / other)})


def test_overlap_sees_through_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PolicyError, match="overlaps the workspace repository"):
        check_overlap(str(tmp_path / "real"), {"workspace repository": str(tmp_path / "link")})


def test_siblings_with_a_common_prefix_do_not_overlap(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "runtime").mkdir()
    check_overlap(str(tmp_path / "runtime"), {"state dir": str(tmp_path / "run")})
