"""pids_room.over_limit reads a pids cgroup and those above it, as the kernel nests their limits."""

from __future__ import annotations

from pathlib import Path

from sandboxer.host import pids_room


def _group(path: Path, limit: str, current: int) -> Path:
    path.mkdir(parents=True)
    (path / "pids.max").write_text(f"{limit}\n")
    (path / "pids.current").write_text(f"{current}\n")
    return path


def test_a_group_at_its_limit_has_room_for_no_more(tmp_path: Path) -> None:
    sandbox = _group(tmp_path / "sandboxer" / "id", "24", 24)
    assert pids_room.over_limit([str(sandbox)], starting=0) is None  # the entering process counted
    assert pids_room.over_limit([str(sandbox)], starting=1) == 24


def test_a_limit_above_the_joined_group_counts(tmp_path: Path) -> None:
    sandbox = _group(tmp_path / "sandboxer" / "id", "24", 25)
    exec_group = _group(sandbox / "sandboxer-exec-1", "max", 1)  # an exec's own group, below
    assert pids_room.over_limit([str(exec_group)], starting=0) == 24


def test_groups_without_a_pids_limit_have_room(tmp_path: Path) -> None:
    memory = tmp_path / "memory" / "id"
    memory.mkdir(parents=True)  # another controller's group: no pids files at all
    unlimited = _group(tmp_path / "pids" / "id", "max", 10_000)
    assert pids_room.over_limit([str(memory), str(unlimited)], starting=1) is None
    assert pids_room.over_limit([], starting=1) is None


def test_the_message_names_the_limit() -> None:
    assert pids_room.full_message(24).startswith("the sandbox is at its pids limit (24): ")
