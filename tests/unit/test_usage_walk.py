"""The walk of a workspace on the host's disk (sandboxer.host.usage.tree_used): it counts what
is below the directory, never what a link inside points at, and says when it stopped early."""

from __future__ import annotations

import os
from pathlib import Path

from sandboxer.host.usage import tree_used


def test_the_walk_counts_the_tree_and_never_follows_a_link(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data").write_bytes(b"x" * (64 << 10))
    (tmp_path / "usr").symlink_to("/usr")  # a link the sandbox made: /usr is the host's
    (tmp_path / "sub" / "up").symlink_to("../..")
    space = tree_used(os.getpid(), str(tmp_path))  # /proc/PID/root of this process is /
    assert space is not None
    assert not space.at_least
    assert 64 << 10 <= space.used_bytes < 1 << 20  # the file and the directories, nothing of /usr


def test_the_walk_stops_at_its_bound_and_says_the_figure_is_a_floor(tmp_path: Path) -> None:
    for n in range(10):
        (tmp_path / f"f{n}").write_bytes(b"y" * 4096)
    space = tree_used(os.getpid(), str(tmp_path), limit=5)
    assert space is not None
    assert space.at_least
    assert tree_used(os.getpid(), str(tmp_path / "missing")) is None
