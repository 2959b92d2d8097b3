"""What `exec` puts between the caller's stdio and the command (sandboxer.execio.stdio.caller_pumps),
in forked children whose fds 0-2 are set up as a caller's might be."""

from __future__ import annotations

import os
import pty
import stat
from pathlib import Path

from sandboxer.errors import ExecUsage
from sandboxer.execio.stdio import caller_pumps


def _in_child(stdio: tuple[int, int, int]) -> str:
    """What caller_pumps makes of these fds as 0, 1, 2: a refusal, or the file type each end given to
    the command has ('fifo' where a pipe stands in front of the caller's)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            try:
                pumps = caller_pumps()
            except ExecUsage as exc:
                answer = str(exc)
            else:
                kinds = [
                    "fifo" if fd != target and stat.S_ISFIFO(os.fstat(fd).st_mode) else "same"
                    for target, fd in enumerate(pumps.given)
                ]
                answer = " ".join(kinds)
            os.write(write_end, answer.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        answer = stream.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_terminals_and_regular_files_get_pipes_and_pipes_do_not(tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    regular = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT, 0o600)
    pipe_r, pipe_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        assert _in_child((terminal, regular, pipe_w)) == "fifo fifo same"
        assert _in_child((pipe_r, devnull, terminal)) == "same same fifo"
    finally:
        for fd in (controller, terminal, regular, pipe_r, pipe_w, devnull):
            os.close(fd)


def test_a_directory_as_stdio_is_refused(tmp_path: Path) -> None:
    directory = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        assert _in_child((devnull, devnull, directory)) == ("exec: stderr is a directory: give it a file or a pipe")
    finally:
        os.close(directory)
        os.close(devnull)
