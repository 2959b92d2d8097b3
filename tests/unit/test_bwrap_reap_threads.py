"""The bwraps a service started are reaped by many threads at once (each teardown and each start
reaps): none of them fails on the table of started processes, and each ended one is collected
once (stop.keep, stop.reap). A root service tearing 8 down at a time failed one teardown in a
hundred with KeyError here, leaving its workspace mount behind (issue 31)."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxer.backends.bwrap import stop
from sandboxer.core.record import SandboxRecord
from sandboxer.core.removal import Removal

REPO = Path(__file__).resolve().parents[2]
# Run apart: the table is the process's, and this fills it with hundreds of ended children.
PROGRAM = """
import subprocess, sys, threading, time
sys.path.insert(0, sys.argv[1])
from sandboxer.backends.bwrap import stop
sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race, if there is one
THREADS, CHILDREN, ROUNDS = 8, 200, 5
errors = []
for _ in range(ROUNDS):
    children = [subprocess.Popen(["true"]) for _ in range(CHILDREN)]
    for child in children:
        stop.keep(child)
    for child in children:  # every one has ended (a zombie until reaped)
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.001)
    start = threading.Barrier(THREADS)
    def reap():
        start.wait()
        try:
            stop.reap()
        except Exception as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=reap) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(child.returncode == 0 for child in children)
stop.reap()
print(len(errors), errors[:3])
"""


def test_many_threads_reap_the_same_ended_bwraps() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(REPO)], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 []\n"


class _Unpollable:
    """A kept process whose poll fails (as a reap's bookkeeping might)."""

    pid = -31
    failing = True

    def poll(self) -> int | None:
        if self.failing:
            raise OSError(errno.ECHILD, "no child")
        return 0


def test_a_reap_that_fails_does_not_stop_the_teardown(caplog: pytest.LogCaptureFixture) -> None:
    """Stopping a sandbox reaps what this process started afterwards: that is our bookkeeping,
    and its failure is logged, never raised, so destroy goes on to the limits, the mounts and
    the directory (a KeyError here once left a workspace mount behind)."""
    broken = _Unpollable()
    stop.keep(broken)  # type: ignore[arg-type]
    try:
        record = SandboxRecord(id="f" * 24, profile="", backend="bwrap", state="failed", created_at="")
        assert stop.stop(record) == Removal()
    finally:
        broken.failing = False
        stop.reap()
    assert f"started failed (teardown of {'f' * 24} goes on)" in caplog.text
