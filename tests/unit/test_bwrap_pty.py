"""The bwrap backend's `exec -t` terminal (sandboxer/backends/bwrap/pty.py), opened here through
this test's own /proc root: the terminal comes from the devpts at /dev/pts that the process's
mount table names, its far end is a named terminal owned as asked, and a holder that is not the
one recorded (a reused pid) gets no terminal."""

from __future__ import annotations

import os

import pytest

from sandboxer.backends.bwrap import pty
from sandboxer.errors import ExecUsage
from sandboxer.host import procs


def test_the_devpts_is_the_one_mounted_at_dev_pts() -> None:
    assert pty.devpts_device(os.getpid()) == os.stat("/dev/pts").st_dev


def test_a_terminal_of_that_devpts_with_its_owner_and_size() -> None:
    start = procs.start_time(os.getpid())
    assert start is not None
    owner = (os.getuid(), os.getgid())
    master, end = pty.opener(os.getpid(), start, owner)((24, 81))
    try:
        name = os.ttyname(end)
        seen = os.stat(name)
        assert name.startswith("/dev/pts/")
        assert seen.st_dev == os.stat("/dev/pts").st_dev
        assert (seen.st_uid, seen.st_gid) == owner
        assert os.get_terminal_size(end) == os.terminal_size((81, 24))
        assert not os.get_inheritable(master)
        assert not os.get_inheritable(end)
        os.write(master, b"ping\n")
        assert os.read(end, 100) == b"ping\n"
    finally:
        os.close(master)
        os.close(end)


def test_a_holder_that_is_not_the_recorded_one_gets_no_terminal() -> None:
    start = procs.start_time(os.getpid())
    assert start is not None
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ExecUsage, match="not running"):
        pty.sandbox_terminal(os.getpid(), start + 1, (os.getuid(), os.getgid()), None)
    assert set(os.listdir("/proc/self/fd")) == before  # nothing left open
