"""An exec's stdio, behind one interface (`Stdio`) that both engines' exec paths ask: this
process's own descriptors (`OwnStdio`, the CLI in-process), those a CLI client passed the service
with its connection (`ClientStdio`), or a program's bytes and callbacks (`Program`: the Python
API, the HTTP API, the broker's own git) — and the pumps each needs (sandboxer.execio.pumps)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from sandboxer.errors import ExecUsage
from sandboxer.execio.pumps import Pumps, writer
from sandboxer.execio.terminal import (
    WINCH_MESSAGE,
    WINCH_SIZE,
    TerminalOpener,
    caller_size,
    caller_terminal,
    open_terminal,
)
from sandboxer.host.ready import wait_ready

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from sandboxer.api.results import Stream

Resize = Callable[[tuple[int, int]], None]  # gives the exec's terminal a window size (rows, columns)
Sink = Callable[[int, bytes], None]  # where a command's output goes: stream 1 or 2, and its bytes

TIMED_OUT = 124  # the status of an exec whose --timeout expired
CALLER_GONE = 128 + 9  # the status of an exec killed because its caller went away
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what reaches an exec's command
CANCEL_POLL = 0.2  # seconds between two questions to Program.cancelled


class Stdio(Protocol):
    """Where an exec's command reads and writes, and how its caller signals it or goes away: what
    an engine's exec path asks (it never asks which kind it has)."""

    @property
    def own_signals(self) -> bool:
        """Whether this process's own signals (SIGINT, SIGTERM, SIGHUP) are the command's: the
        CLI in-process. Elsewhere they are the service's or the program's own business."""
        ...

    @property
    def cancelled(self) -> Callable[[], bool] | None:
        """Asked a few times a second while the command runs (None: never): once it says yes, the
        caller went away, and everything the exec started is killed (CALLER_GONE)."""
        ...

    def control(self) -> Control | None:
        """The caller's signals and window sizes as a connection carries them (None: none do)."""
        ...

    def window(self) -> tuple[int, int] | None:
        """exec -t: the caller's window size, for the command's terminal; ExecUsage where the
        caller has no terminal to copy to (a program's stdio)."""
        ...

    def pumps(self, *, tty: bool, opener: TerminalOpener = open_terminal) -> Pumps:
        """The descriptors the command gets as its 0-2 and the copying between them and the
        caller (`tty`: the far end of a new terminal of its own, from `opener`: the sandbox's)."""
        ...

    def streams(self) -> AbstractContextManager[tuple[int, Sink]]:
        """For an engine that copies the command's stdio itself (the Docker Engine): a descriptor
        of the caller's input and a sink for the command's output, for the block."""
        ...

    def terminal(self, resize: Resize | None) -> AbstractContextManager[None]:
        """For the block of an exec with a terminal of its own (`resize` sets its window size;
        None: none): the caller's terminal in raw mode, and its size changes passed on — where
        this process holds the caller's terminal."""
        ...

    def tell(self, data: bytes) -> None:
        """Write a line of the broker's on the exec's stderr (OSError: it is gone)."""
        ...


class Program:
    """The stdio of an exec a program runs (the Python API, the service): `stdin` is all of its
    input, or a pipe's read end the program feeds as it goes (the service streams a request's
    body into it), and `output(stream, chunk)` receives what it writes as it arrives ("stdout" or
    "stderr"). Signals to the calling process are its own business then: none are forwarded.
    `cancelled`, when given, is asked a few times a second: once it says yes (the service's
    client went away), everything the exec started is killed and it ends with CALLER_GONE.
    `signals`, when given, is a pipe's read end on which the program sends signals for the
    command, a byte each (SIGINT, SIGTERM, SIGHUP: as a CLI client's connection carries them,
    see Control); its end, like the client's, means the program went away."""

    __slots__ = ("cancelled", "output", "signals", "stdin")

    def __init__(
        self,
        stdin: bytes | int,
        output: Callable[[Stream, bytes], None],
        cancelled: Callable[[], bool] | None = None,
        signals: int | None = None,
    ) -> None:
        self.stdin = stdin
        self.output = output
        self.cancelled = cancelled
        self.signals = signals

    own_signals = False

    def control(self) -> Control | None:
        """The program's signals as a CLI client's are read (None: it sends none)."""
        return None if self.signals is None else Control(self.signals)

    def window(self) -> tuple[int, int] | None:
        """A program has no terminal to copy a command's to."""
        raise ExecUsage("exec: -t: a terminal is for a caller's own stdio, not a program's")

    def pumps(self, *, tty: bool, opener: TerminalOpener = open_terminal) -> Pumps:
        """Pipes for all three: the input given at once (or the program's own pipe, handed over),
        the output to the program's sink."""
        if tty:
            self.window()  # refused
        return program_pumps(self)

    @contextlib.contextmanager
    def streams(self) -> Iterator[tuple[int, Sink]]:
        """The program's input as a descriptor (its own pipe, or a memfd of its bytes, closed
        after the block) and its sink."""

        def output(stream: int, chunk: bytes) -> None:
            self.output("stdout" if stream == 1 else "stderr", chunk)

        if isinstance(self.stdin, int):
            yield self.stdin, output
            return
        stdin = feeder(self.stdin)
        try:
            yield stdin, output
        finally:
            os.close(stdin)

    def terminal(self, resize: Resize | None) -> AbstractContextManager[None]:
        """Nothing: the program holds no terminal of the caller's."""
        return contextlib.nullcontext()

    def tell(self, data: bytes) -> None:
        """The line goes to the program's sink as the command's stderr does."""
        self.output("stderr", data)


class Watchdog:
    """An exec's --timeout kept by a timer thread as well as by the exec's own loop: at the
    deadline it kills the exec (`kill`) even while that loop is blocked handing output to a
    caller that stopped reading (a program's sink, a client's pipe), so no caller can keep a
    command past its timeout. `fired`: it killed. A context manager; stop() — and the block's
    end — keeps it from killing from then on (waiting for a kill under way): the exec loop
    calls it as soon as it sees the command end, before the command's pid can be reused."""

    def __init__(self, timeout: float | None, kill: Callable[[], None]) -> None:
        self.fired = False
        self._kill = kill
        self._lock = threading.Lock()
        self._stopped = False
        self._timer = None if timeout is None else threading.Timer(timeout, self._fire)

    def _fire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.fired = True
            self._kill()

    def stop(self) -> None:
        """No kill from now on; returns once a kill under way is done (`fired` is final then)."""
        with self._lock:
            self._stopped = True

    def __enter__(self) -> Watchdog:
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()


class Control:
    """A CLI client's connection to the service while its exec runs: each byte the client sends
    is a signal number for the command (its Ctrl-C, its SIGTERM), or WINCH_MESSAGE and four
    bytes, its terminal's new window size (`exec -t`); the connection's end means the client
    went away — the exec is then killed with everything it started."""

    __slots__ = ("_partial", "fd", "gone", "size")

    def __init__(self, fd: int, size: tuple[int, int] | None = None) -> None:
        self.fd = fd
        self.gone = False
        self.size = size  # the client's window size, as it last said
        self._partial = b""  # a window size message not read whole yet

    def signals(self) -> list[int]:
        """The signals the client sent since the last call (without waiting; only SIGINT, SIGTERM
        and SIGHUP, which an in-process exec forwards too); at the connection's end, `gone`.
        A window size it sent meanwhile is `size` now."""
        if self.gone or not wait_ready([self.fd], timeout=0)[0]:
            return []
        try:
            data = os.read(self.fd, 64)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            self.gone = True
        data, self._partial = self._partial + data, b""
        found = []
        while data:
            if data[0] == WINCH_MESSAGE:
                if len(data) < 1 + WINCH_SIZE.size:
                    self._partial = data
                    break
                rows, columns = WINCH_SIZE.unpack(data[1 : 1 + WINCH_SIZE.size])
                self.size = (rows, columns) if rows and columns else self.size
                data = data[1 + WINCH_SIZE.size :]
                continue
            if data[0] in FORWARDED:
                found.append(data[0])
            data = data[1:]
        return found


class ClientStdio:
    """A CLI client's stdio, in the service: the descriptors it passed for the command's 0-2
    (pipes are put in front of a terminal or a regular file), and its connection (`Control`):
    its signals, its window size, its going away."""

    __slots__ = ("_control", "fds")
    own_signals = False
    cancelled = None  # the client's going away is its connection's end (Control.gone)

    def __init__(self, fds: tuple[int, int, int], control: Control | None) -> None:
        self.fds = fds
        self._control = control

    def control(self) -> Control | None:
        """The client's connection."""
        return self._control

    def window(self) -> tuple[int, int] | None:
        """The window size the client last said (over its connection), else its terminal's."""
        return caller_size(self.fds) if self._control is None else self._control.size

    def pumps(self, *, tty: bool, opener: TerminalOpener = open_terminal) -> Pumps:
        """The caller's descriptors as they are, or behind pipes; with `tty`, a new terminal."""
        if tty:
            return terminal_pumps(self.fds[0], self.fds[1], self.window(), opener)
        return caller_pumps(self.fds)

    @contextlib.contextmanager
    def streams(self) -> Iterator[tuple[int, Sink]]:
        """The caller's stdin, and its stdout and stderr as the sink."""
        yield self.fds[0], to_fds(self.fds[1], self.fds[2])

    def terminal(self, resize: Resize | None) -> AbstractContextManager[None]:
        """Nothing here: the client holds its terminal, and sends its size changes (Control)."""
        return contextlib.nullcontext()

    def tell(self, data: bytes) -> None:
        """The line goes to the caller's stderr."""
        os.write(self.fds[2], data)


class OwnStdio(ClientStdio):
    """This process's own fds 0-2 (the CLI in-process): its signals are the command's, and its
    terminal is the caller's — in raw mode while an exec -t runs, its size changes passed on."""

    __slots__ = ()
    own_signals = True

    def __init__(self) -> None:
        super().__init__((0, 1, 2), None)

    def terminal(self, resize: Resize | None) -> AbstractContextManager[None]:
        """The caller's terminal in raw mode, its size changes (SIGWINCH) given to `resize`."""
        return caller_terminal(resize, self.fds)


def program_pumps(program: Program) -> Pumps:
    """Pipes for all three of a program's exec: the input given at once (or the program's own
    pipe, handed over), the output to the program's sink."""
    pumps = Pumps()
    try:
        if isinstance(program.stdin, int):
            pumps.given[0], pumps.stdin_source = program.stdin, None
        else:
            pumps.pipe_in()
            pumps.stdin_source, pumps.pending = None, program.stdin
            if not pumps.pending:
                pumps.end_stdin()
        pumps.pipe_out(1, lambda chunk: program.output("stdout", chunk))
        pumps.pipe_out(2, lambda chunk: program.output("stderr", chunk))
    except BaseException:
        pumps.given_away()
        pumps.close()
        raise
    return pumps


def caller_pumps(fds: tuple[int, int, int] = (0, 1, 2)) -> Pumps:
    """The pumps a caller's descriptors (this process's fds 0-2 by default) need (see Pumps)."""
    pumps = Pumps()
    pumps.given = list(fds)
    pumps.stdin_source = fds[0]
    try:
        for target, fd in enumerate(fds):
            try:
                mode = os.fstat(fd).st_mode
            except OSError:
                continue  # closed: the command gets it closed too
            if stat.S_ISDIR(mode) or stat.S_ISBLK(mode):
                what = "a directory" if stat.S_ISDIR(mode) else "a block device"
                raise ExecUsage(f"exec: {('stdin', 'stdout', 'stderr')[target]} is {what}: give it a file or a pipe")
            if not (stat.S_ISREG(mode) or os.isatty(fd)):
                continue
            if target == 0:
                pumps.pipe_in()
            else:
                pumps.pipe_out(target, writer(fd))
    except BaseException:
        pumps.given_away()
        pumps.close()
        raise
    return pumps


def terminal_pumps(
    source: int, out: int, size: tuple[int, int] | None, opener: TerminalOpener = open_terminal
) -> Pumps:
    """`exec -t` (sandboxer.execio.terminal): the command's 0-2 are the far end of a new terminal of
    `size` (`opener`'s); the caller's input `source` is copied into it, and what the command writes
    to it to the caller's `out`."""
    pumps = Pumps()
    master, end = opener(size)
    pumps.given = [end, end, end]
    pumps.theirs.append(end)
    pumps.outputs[master] = writer(out)
    pumps.stdin_source = source
    pumps.stdin_sink = fcntl.fcntl(master, fcntl.F_DUPFD_CLOEXEC, 3)
    os.set_blocking(pumps.stdin_sink, False)
    # Its own copy for window sizes, open until close(): never a number another file took.
    pumps.terminal = fcntl.fcntl(master, fcntl.F_DUPFD_CLOEXEC, 3)
    pumps.end_of_input = b"\x04"  # the caller's input ended: the terminal's end-of-file key
    return pumps


def feeder(data: bytes) -> int:
    """A descriptor to read `data` from, then its end: a sealed memfd (no thread, no pipe limit)."""
    fd = os.memfd_create("sandboxer-stdin", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def to_fds(stdout: int, stderr: int) -> Sink:
    """An output sink that writes stream 1 to `stdout` and 2 to `stderr` (OSError: it refused)."""
    targets = {1: stdout, 2: stderr}

    def write(stream: int, payload: bytes) -> None:
        fd = targets.get(stream)
        view = memoryview(payload)
        while fd is not None and view:
            view = view[os.write(fd, view) :]

    return write
