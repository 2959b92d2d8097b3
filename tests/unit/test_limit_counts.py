"""limit_events' counts: read from each cgroup's own flat-keyed files (v1's memory.oom_control,
v2's memory.events, pids.events), the exec groups below a sandbox's included."""

from __future__ import annotations

from pathlib import Path

from sandboxer.host.limit_events import Counts, _counts


def test_counts_add_up_every_groups_own_files_and_the_groups_below(tmp_path: Path) -> None:
    memory, pids, v2 = tmp_path / "memory" / "sbx", tmp_path / "pids" / "sbx", tmp_path / "unified" / "sbx"
    for directory in (memory, pids / "exec-a", pids / "exec-b", v2 / "exec-c"):
        directory.mkdir(parents=True)
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (pids / "pids.events").write_text("max 1\n")
    (pids / "exec-a" / "pids.events").write_text("max 4\n")
    (pids / "exec-b" / "pids.events").write_text("max 0\n")
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n")
    (v2 / "pids.events").write_text("max 3\n")
    (v2 / "exec-c" / "memory.events").write_text("oom_kill 5\n")
    (v2 / "exec-c" / "pids.events").write_text("max 2\n")

    assert _counts([str(memory), str(pids)]) == Counts(oom_kills=2, pid_refusals=5)
    # v2's memory.events has a "max" line too: only pids.events' counts refused forks.
    assert _counts([str(v2)]) == Counts(oom_kills=6, pid_refusals=5)
    assert _counts([str(tmp_path / "gone")]) == Counts(oom_kills=0, pid_refusals=0)
