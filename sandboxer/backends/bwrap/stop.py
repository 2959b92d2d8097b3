"""Stopping a bwrap sandbox: kill every process it has, and reap the bwrap this process started.

Kept apart from the rest of the backend so that teardown and gc import only this.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import TYPE_CHECKING

from sandboxer.core.removal import Removal
from sandboxer.host import procs

if TYPE_CHECKING:
    import subprocess

    from sandboxer.core.record import SandboxRecord

log = logging.getLogger("sandboxer.service")


class StartedBwraps:
    """The bwrap processes this process started (namespace.start), each reaped once it ended.

    The CLI exits after a create; a program using the Python API, and the service, live on, and
    must reap each bwrap once its sandbox has stopped, or it stays a zombie: `stop` and every
    later start reap those that ended, and so does the program's exit (a sandbox another process
    tore down has left its bwrap here, unreaped). In the service, teardowns, creates and warm
    fills on many threads keep and reap at once: the table is this object's alone, changed only
    under its lock, and a process is taken out of it by exactly one reaper (two that both saw
    it end once failed a teardown with KeyError half-way, its mounts left behind).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._at_exit = False

    def keep(self, process: subprocess.Popen[bytes]) -> None:
        """Reap `process`, a bwrap this process started, once its sandbox has stopped."""
        with self._lock:
            if not self._at_exit:
                atexit.register(self.reap)
                self._at_exit = True
            self._processes[process.pid] = process

    def reap(self) -> None:
        """Collect the exit of every kept bwrap that has ended since. Popen.poll is safe from
        many threads (it holds a lock of its own around waitpid); the table's lock is not held
        across it, so a reap never waits on another's system calls."""
        with self._lock:
            kept = list(self._processes.items())
        ended = [pid for pid, process in kept if process.poll() is not None]
        with self._lock:
            for pid in ended:
                self._processes.pop(pid, None)  # another reaper may have taken it already


STARTED = StartedBwraps()  # this process's: one table for every thread
keep = STARTED.keep
reap = STARTED.reap


def stop(record: SandboxRecord) -> Removal:
    """Kill every process of the bwrap sandbox (procs.stop_sandbox), then reap the bwrap this
    process started for it. Reaping is our own bookkeeping: should it fail,
    the bwrap is collected by the next reap or at exit, and the rest of the teardown (limits,
    mounts, the directory) still runs."""
    stopped = procs.stop_sandbox(record.id, record.processes)
    try:
        reap()
    except Exception:  # never a reason to leave the sandbox's mounts behind
        log.exception("reaping the bwraps this process started failed (teardown of %s goes on)", record.id)
    return stopped
