"""The pipes between an exec's command and its caller's stdio, and the copying between them: the
exec's hot path (plain os calls), shared by the service's exec paths (sandboxer.execio.stdio makes
their pumps) and the CLI client, which copies its terminal and files to and from the pipes it
passes the service (Pumps.for_client) — so this module imports little (tests/unit/
test_cli_client_imports.py)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

from sandboxer.host.ready import wait_ready


class Pumps:
    """Pipes in front of the caller's stdio where handing it over would give the command more
    than a stream, and the copying between them (the exec's hot path: plain os calls).

    A terminal: the command could go on reading the caller's keystrokes after the exec returned
    (a background process keeps the descriptor) and drive the terminal. A regular file: the
    command could reopen it through /proc/self/fd for reading (what the caller wrote there
    before) or, as the same uid, for writing. Pipes, sockets and other character devices
    (/dev/null) are handed over as they are; a directory or a block device is refused.
    """

    def __init__(self) -> None:
        self.given = [0, 1, 2]  # what the command gets as its fds 0, 1, 2
        self.stdin_source: int | None = 0  # where more input comes from; None: `pending` is all
        self.stdin_sink = -1  # our end of the command's stdin pipe
        self.pending = b""  # read from the caller's stdin, not yet in the pipe
        self.outputs: dict[int, Callable[[bytes], None]] = {}  # our read end -> where its bytes go
        self.terminal: int | None = None  # exec -t: the master of the command's terminal (a copy)
        self.end_of_input = b""  # what to write into stdin when the caller's input ends (a terminal's ^D)
        self.theirs: list[int] = []  # the ends the command holds copies of, once started

    def pipe_in(self) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self.given[0], self.stdin_sink = read_end, write_end
        os.set_blocking(write_end, False)
        self.theirs.append(read_end)

    def pipe_out(self, target: int, sink: Callable[[bytes], None]) -> None:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        self.given[target] = write_end
        self.outputs[read_end] = sink
        self.theirs.append(write_end)

    @classmethod
    def for_client(cls) -> Pumps:
        """This process's stdio as the CLI client hands it to the service: its own pipes as they
        are, anything else (a terminal, a file, a socket, a device, a closed descriptor) behind a
        pipe this process copies — so what reaches the caller's files and terminal is written and
        read by the caller's own process, never by a root service."""
        pumps = cls()
        try:
            for target in (0, 1, 2):
                try:
                    if stat.S_ISFIFO(os.fstat(target).st_mode):
                        continue  # handed over as it is
                    closed = False
                except OSError:
                    closed = True
                if target == 0:
                    pumps.pipe_in()
                    if closed:
                        pumps.end_stdin()  # the command reads its end at once
                else:
                    pumps.pipe_out(target, discard if closed else writer(target))
        except BaseException:
            pumps.given_away()
            pumps.close()
            raise
        return pumps

    def given_away(self) -> None:
        """The command has its copies: close ours of its ends."""
        for fd in self.theirs:
            os.close(fd)
        self.theirs = []

    def readers(self) -> list[int]:
        """What to wait on for reading."""
        source = self.stdin_source
        waiting = [source] if source is not None and self.stdin_sink >= 0 and not self.pending else []
        return [*waiting, *self.outputs]

    def writers(self) -> list[int]:
        """What to wait on for writing."""
        return [self.stdin_sink] if self.stdin_sink >= 0 and self.pending else []

    def pump(self, readable: list[int], writable: list[int]) -> None:
        """Copy what is ready."""
        for fd in readable:
            if fd in self.outputs and not _copy(fd, self.outputs[fd]):
                os.close(fd)
                del self.outputs[fd]
            elif fd == self.stdin_source and self.stdin_sink >= 0:
                try:
                    self.pending = os.read(fd, 65536)
                except OSError:
                    self.pending = b""
                if not self.pending:
                    if self.end_of_input:
                        with contextlib.suppress(OSError):
                            os.write(self.stdin_sink, self.end_of_input)
                    self.end_stdin()
        if self.stdin_sink in writable:
            try:
                self.pending = self.pending[os.write(self.stdin_sink, self.pending) :]
            except BlockingIOError:
                pass
            except OSError:  # the command closed its stdin
                self.end_stdin()
            if not self.pending and self.stdin_source is None:
                self.end_stdin()  # all of it is in: the command reads its end

    def end_stdin(self) -> None:
        if self.stdin_sink >= 0:
            os.close(self.stdin_sink)
        self.stdin_sink, self.pending = -1, b""

    def finish(self) -> None:
        """The command ended: no more of the caller's stdin reaches what it left behind, and its
        output written before it ended is copied; a background process of the exec that still
        holds a pipe does not hold the caller up (it gets EOF and EPIPE from now on)."""
        self.end_stdin()
        for read_end, target in self.outputs.items():
            os.set_blocking(read_end, False)
            while _copy(read_end, target):
                try:
                    if not wait_ready([read_end], timeout=0)[0]:
                        break
                except InterruptedError:
                    continue

    def close(self) -> None:
        """Close every end of ours."""
        self.end_stdin()
        for read_end in self.outputs:
            os.close(read_end)
        self.outputs = {}
        if self.terminal is not None:
            os.close(self.terminal)
            self.terminal = None


def _copy(read_end: int, sink: Callable[[bytes], None]) -> bool:
    """Hand what one output pipe holds to its sink; False at its end."""
    try:
        data = os.read(read_end, 65536)
    except BlockingIOError:
        return True
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return False  # a terminal's master once nothing holds its far end any more
    if not data:
        return False
    sink(data)
    return True


def writer(target: int) -> Callable[[bytes], None]:
    """A sink writing to the caller's fd `target`."""

    def write(data: bytes) -> None:
        while data:
            try:
                data = data[os.write(target, data) :]
            except OSError:
                return  # the caller's file or terminal refuses: the command's output is dropped

    return write


def discard(data: bytes) -> None:
    """The sink of an output whose descriptor was closed."""
