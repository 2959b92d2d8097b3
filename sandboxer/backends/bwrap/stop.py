"""Stopping a bwrap sandbox: kill every process it has, and reap the bwrap this process started.

Kept apart from the rest of the backend so that teardown and gc import only this.
"""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

from sandboxer.host import procs

if TYPE_CHECKING:
    import subprocess

    from sandboxer.core.record import SandboxRecord

# The bwrap processes this process started (bwrap.start). The CLI exits after a create; a
# program using the Python API lives on, and must reap each bwrap once its sandbox has stopped,
# or it stays a zombie: `stop` and every later start reap those that ended, and so does the
# program's exit (a sandbox another process tore down has left its bwrap here, unreaped).
STARTED: dict[int, subprocess.Popen[bytes]] = {}


def keep(process: subprocess.Popen[bytes]) -> None:
    """Reap `process`, a bwrap this process started, once its sandbox has stopped."""
    if not STARTED:
        atexit.unregister(reap)  # at most once
        atexit.register(reap)
    STARTED[process.pid] = process


def reap() -> None:
    """Collect the exit of every bwrap this process started that has ended since."""
    for pid, process in list(STARTED.items()):
        if process.poll() is not None:
            del STARTED[pid]


def stop(record: SandboxRecord) -> tuple[list[str], list[str]]:
    """Kill every process of the bwrap sandbox (procs.stop_sandbox), then reap the bwrap this
    process started for it: (removed, residue)."""
    removed, residue = procs.stop_sandbox(record.id, record.processes)
    reap()
    return removed, residue
