"""Stopping a bwrap sandbox: kill every process it has, and say what was left.

Kept apart from the rest of the backend so that teardown and gc import only this.
"""

from __future__ import annotations

import os

from sandboxer import procs

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess

# The bwrap processes this process started (bwrap.start). The CLI exits after a create; a
# program using the Python API lives on, and must reap each bwrap once its sandbox has stopped,
# or it stays a zombie: `stop` and every later start reap those that ended.
STARTED: dict[int, subprocess.Popen[bytes]] = {}


def reap() -> None:
    """Collect the exit of every bwrap this process started that has ended since."""
    for pid, process in list(STARTED.items()):
        if process.poll() is not None:
            del STARTED[pid]


def stop(record: dict[str, object], *, grace: float = 1.0) -> tuple[list[str], list[str]]:
    """Kill every process of the sandbox: TERM, grace, KILL; returns (removed, residue)."""
    removed: list[str] = []
    residue: list[str] = []
    targets: set[int] = set()
    pid_namespace = record.get("pid_namespace")
    init_pid, init_start = record.get("init_pid"), record.get("init_start")
    # A namespace number is reused by the kernel once the namespace is gone, so it is trusted
    # only while the sandbox's own init (checked by start time) still lives in it. When that
    # init is dead, the kernel has already killed every process of the namespace.
    namespace_is_ours = (
        isinstance(pid_namespace, int)
        and isinstance(init_pid, int)
        and isinstance(init_start, int)
        and procs.alive(init_pid, init_start)
        and procs.namespace_inode(init_pid, "pid") == pid_namespace
    )
    if namespace_is_ours and isinstance(pid_namespace, int):
        targets.update(procs.in_pid_namespace(pid_namespace))
    for key in ("bwrap", "init", "holder"):
        pid, started = record.get(f"{key}_pid"), record.get(f"{key}_start")
        if isinstance(pid, int) and isinstance(started, int) and procs.alive(pid, started):
            targets.add(pid)
    sandbox_id = record.get("id")
    if isinstance(sandbox_id, str):
        # A bwrap whose pids never reached the record still carries the id in its argv.
        targets.update(procs.with_marker(f"SANDBOXER_SANDBOX_ID\0{sandbox_id}\0".encode()))
    targets.discard(os.getpid())
    if targets:
        survivors = procs.terminate(sorted(targets), grace=grace)
        removed.append(f"processes: {len(targets) - len(survivors)}")
        residue.extend(f"process {pid} still running" for pid in survivors)
    if namespace_is_ours and isinstance(pid_namespace, int):
        late = procs.in_pid_namespace(pid_namespace)
        if late:
            survivors = procs.terminate(late, grace=0.0)
            residue.extend(f"process {pid} still running" for pid in survivors)
    reap()
    return removed, residue
