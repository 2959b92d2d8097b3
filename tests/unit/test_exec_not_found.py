"""Why a program was not found, as the bwrap exec says it (sandboxer/backends/bwrap/command.py):
a link on its path that leads nowhere is named, with where it leads."""

from __future__ import annotations

import os
from pathlib import Path

from sandboxer.backends.bwrap.command import _dangling


def test_a_dangling_link_on_the_path_is_named(tmp_path: Path) -> None:
    empty, links = tmp_path / "empty", tmp_path / "links"
    empty.mkdir()
    links.mkdir()
    os.symlink("/etc/alternatives/no-such-awk", links / "awk")
    env = {"PATH": f"{empty}:{links}"}
    assert _dangling("awk", env) == f"{links}/awk is a dangling link (to /etc/alternatives/no-such-awk)"
    assert _dangling(str(links / "awk"), {}) == f"{links}/awk is a dangling link (to /etc/alternatives/no-such-awk)"


def test_a_program_found_nowhere_is_not_found(tmp_path: Path) -> None:
    os.symlink(tmp_path, tmp_path / "fine")  # a link that leads somewhere is not the reason
    assert _dangling("fine-tool", {"PATH": str(tmp_path)}) == "not found"
    assert _dangling("tool", {}) == "not found"
