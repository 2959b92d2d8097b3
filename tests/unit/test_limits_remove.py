"""limits.remove: an exec's group that cannot be removed (busy, or removed by its exec's own
thread meanwhile) does not keep the others, or the next group, from being removed."""

from __future__ import annotations

from pathlib import Path

from sandboxer.host import limits


def test_one_busy_exec_group_leaves_only_itself_and_its_parent(tmp_path: Path) -> None:
    busy, idle = tmp_path / "pids" / "exec-busy", tmp_path / "memory"
    for name in ["exec-busy", *(f"exec-{n:02}" for n in range(50))]:  # the busy one rarely listed last
        (tmp_path / "pids" / name).mkdir(parents=True)
    (busy / "cgroup.procs").write_text("")  # not empty: rmdir fails, as for a cgroup with members
    (idle / "exec-b").mkdir(parents=True)
    left = limits.remove((str(tmp_path / "pids"), str(idle), str(tmp_path / "gone")))
    assert left == [str(tmp_path / "pids")]
    assert sorted(p.name for p in (tmp_path / "pids").iterdir()) == ["exec-busy"]
    assert not idle.exists()
