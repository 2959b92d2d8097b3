"""procs' facts from /proc/PID/stat, on real processes: a pid is alive only while it runs as
the same process (its start time) and is not a zombie; its state and session as the host sees
them."""

from __future__ import annotations

import os
import subprocess
import time

from sandboxer.host import procs


def test_alive_means_running_the_same_process_and_not_a_zombie() -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        started = procs.start_time(child.pid)
        assert started is not None
        assert procs.alive(child.pid, started)
        assert not procs.alive(child.pid, started + 1)  # a recycled pid has another start time
        assert procs.state(child.pid) in ("R", "S")  # running, or asleep already
        assert procs.session_of(child.pid) == os.getsid(child.pid) == child.pid
        child.kill()
        deadline = time.monotonic() + 10
        while procs.state(child.pid) != "Z":  # exited, not reaped yet
            assert time.monotonic() < deadline, procs.state(child.pid)
            time.sleep(0.01)
        assert procs.start_time(child.pid) == started
        assert not procs.alive(child.pid, started)
        assert procs.wait_gone([child.pid], timeout=0) == []  # a zombie counts as gone
    finally:
        child.kill()
        child.wait()
    assert procs.state(child.pid) is None
    assert procs.start_time(child.pid) is None
    assert not procs.alive(child.pid, started)
