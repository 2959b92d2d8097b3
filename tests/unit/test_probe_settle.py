"""What is read of a starting sandbox's processes is read once they have settled: the probe's
environment once the kernel has laid it out, bwrap's init's descriptors once it has closed
what it inherited."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sandboxer.backends.bwrap import live as bwrap


def test_an_empty_environment_is_read_again_until_the_exec_has_finished(tmp_path: Path) -> None:
    environ = tmp_path / "environ"
    environ.write_bytes(b"")  # what /proc/PID/environ shows between close-on-exec and the new stack
    timer = threading.Timer(0.05, environ.write_bytes, args=(b"PATH=/usr/bin\0HOME=/home/sandbox\0",))
    timer.start()
    try:
        assert bwrap._settled_environ(str(tmp_path)) == b"PATH=/usr/bin\0HOME=/home/sandbox\0"
    finally:
        timer.cancel()


def test_an_environment_that_stays_empty_is_reported_as_empty_after_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "environ").write_bytes(b"")
    monkeypatch.setattr(bwrap, "_PROBE_SETTLE_SECONDS", 0.02)
    assert bwrap._settled_environ(str(tmp_path)) == b""


def test_a_vanished_probe_is_an_os_error_not_a_wait(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        bwrap._settled_environ(str(tmp_path / "gone"))


HOLDS = (
    "import sys\n"
    "held = open(sys.argv[1])\n"
    "print('open', flush=True)\n"
    "sys.stdin.read(1)\n"
    "held.close()\n"
    "print('closed', flush=True)\n"
    "sys.stdin.read()\n"
)


def _holding(path: Path) -> subprocess.Popen[bytes]:
    """A process with `path` open until a byte arrives on its stdin (pipes and /dev/null else)."""
    path.write_text("a host file\n")
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDS, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"open\n"
    return process


def _ended(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.communicate()


def test_a_descriptor_init_closes_soon_after_is_no_problem(tmp_path: Path) -> None:
    """bwrap's init closes what it inherited just after its fork; under load the check can come
    first: the host file it still holds is looked at again until it is closed."""
    process = _holding(tmp_path / "held")
    try:
        base = f"/proc/{process.pid}"
        (problem,) = bwrap._fd_problems("init", base, must_read=True)  # unsettled: seen at once
        assert problem.startswith("init: descriptor ")
        assert problem.endswith(" is open on a host file")
        stdin = process.stdin
        assert stdin is not None

        def close_it() -> None:
            stdin.write(b"x")
            stdin.flush()

        timer = threading.Timer(0.1, close_it)
        timer.start()
        try:
            assert bwrap._fd_problems("init", base, must_read=True, settle=True) == []
        finally:
            timer.cancel()
    finally:
        _ended(process)


def test_a_descriptor_init_keeps_is_a_problem_after_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bwrap, "_PROBE_SETTLE_SECONDS", 0.05)
    process = _holding(tmp_path / "held")
    try:
        (problem,) = bwrap._fd_problems("init", f"/proc/{process.pid}", must_read=True, settle=True)
        assert problem.endswith(" is open on a host file")
    finally:
        _ended(process)
