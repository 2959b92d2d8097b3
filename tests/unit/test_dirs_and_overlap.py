"""Directory resolution and the runtime overlap rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxer.core.runtime import check_overlap
from sandboxer.dirs import own_configuration, resolve_dirs, service_socket
from sandboxer.errors import PolicyError


def test_root_defaults() -> None:
    """Root's state is on disk (workspaces can be large); its service's socket is in /run."""
    dirs = resolve_dirs(config_dir=None, state_dir=None, environ={}, euid=0, home="/root")
    assert (dirs.config, dirs.state) == ("/etc/sandboxer", "/var/lib/sandboxer")
    assert service_socket(dirs, {}) == "/run/sandboxer/broker.sock"
    assert service_socket(dirs, {"SANDBOXER_SOCKET": "/tmp/s.sock"}) == "/tmp/s.sock"
    other = resolve_dirs(config_dir=None, state_dir="/srv/state", environ={}, euid=0, home="/root")
    assert service_socket(other, {}) == "/srv/state/broker.sock"


def test_own_configuration_is_a_named_directory_or_socket_or_a_default_config_dir(tmp_path: Path) -> None:
    """What makes an account other than root a broker of its own rather than a caller of the
    system service (docs/service.md, "Finding the service")."""
    home = str(tmp_path)

    def own(config_dir: str | None = None, state_dir: str | None = None, **environ: str) -> bool:
        return own_configuration(config_dir=config_dir, state_dir=state_dir, environ=environ, home=home)

    assert not own()
    assert own(config_dir="/srv/c")
    assert own(state_dir="/srv/s")
    for name in ("SANDBOXER_SOCKET", "SANDBOXER_CONFIG", "SANDBOXER_STATE"):
        assert own(**{name: "/srv/x"})
    assert not own(SANDBOXER_SOCKET="")  # set but empty: nothing named
    (tmp_path / ".config" / "sandboxer").mkdir(parents=True)
    assert own()
    assert not own(XDG_CONFIG_HOME=str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere" / "sandboxer").mkdir(parents=True)
    assert own(XDG_CONFIG_HOME=str(tmp_path / "elsewhere"))


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
