"""`exec -t`: a terminal of the command's own, never the caller's.

The broker opens a new pseudo-terminal for the exec; the command gets its far end as stdin,
stdout, stderr and controlling terminal (a session of its own), so job control works in an
interactive shell, and the broker copies between it and the caller's stdio. The caller's own
terminal stays with the caller: a command cannot push keystrokes into it (TIOCSTI is refused by
the syscall policy anyway) nor change its modes. The caller's terminal is put in raw mode while
the exec runs (keys reach the command as typed, Ctrl-C included) and restored after; its window
size is given to the exec's terminal at the start and whenever it changes (SIGWINCH in the
process that holds the caller's terminal: the CLI in-process, or the CLI client, which sends it
to the service).

TERM is the caller's when it names a terminal type every system knows the terminfo of (below),
else xterm-256color: a caller's arbitrary string does not become part of the sandbox's
environment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import termios
from collections.abc import Callable, Iterator, Mapping

TERMS = frozenset(
    {
        "dumb",
        "linux",
        "vt100",
        "vt220",
        "xterm",
        "xterm-color",
        "xterm-256color",
        "screen",
        "screen-256color",
        "tmux",
        "tmux-256color",
        "rxvt-unicode",
        "rxvt-unicode-256color",
        "alacritty",
        "xterm-kitty",
    }
)
DEFAULT_TERM = "xterm-256color"
_WINSIZE = struct.Struct("HHHH")  # struct winsize: rows, columns, and two unused pixel sizes
WINCH_MESSAGE = 28  # a CLI client's control byte for "the window size is now": 4 bytes follow
WINCH_SIZE = struct.Struct(">HH")  # rows, columns


def term_of(environ: Mapping[str, str]) -> str:
    """The exec's TERM: the caller's when it is one of TERMS, else DEFAULT_TERM."""
    term = environ.get("TERM", "")
    return term if term in TERMS else DEFAULT_TERM


TerminalOpener = Callable[[tuple[int, int] | None], tuple[int, int]]  # open_terminal's shape


def open_terminal(size: tuple[int, int] | None) -> tuple[int, int]:
    """A new pseudo-terminal (master, the command's end), both close-on-exec, at `size`."""
    master, end = os.openpty()
    os.set_inheritable(master, False)
    os.set_inheritable(end, False)
    if size is not None:
        set_size(master, size)
    return master, end


def size_of(fd: int) -> tuple[int, int] | None:
    """(rows, columns) of the terminal `fd`, or None when it is not one."""
    try:
        rows, columns, _, _ = _WINSIZE.unpack(fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(_WINSIZE.size)))
    except OSError:
        return None
    return (rows, columns) if rows and columns else None


def set_size(fd: int, size: tuple[int, int]) -> None:
    """Give the terminal `fd` the window size (rows, columns); its foreground gets SIGWINCH."""
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, _WINSIZE.pack(size[0], size[1], 0, 0))


@contextlib.contextmanager
def raw(fd: int) -> Iterator[None]:
    """The caller's terminal `fd` in raw mode for the block (nothing when it is not a terminal),
    its modes as they were afterwards."""
    try:
        saved = termios.tcgetattr(fd)
    except termios.error:
        yield
        return
    mode = termios.tcgetattr(fd)
    mode[0] &= ~(termios.BRKINT | termios.ICRNL | termios.INPCK | termios.ISTRIP | termios.IXON)
    mode[1] &= ~termios.OPOST
    mode[2] = (mode[2] & ~(termios.CSIZE | termios.PARENB)) | termios.CS8
    mode[3] &= ~(termios.ECHO | termios.ICANON | termios.IEXTEN | termios.ISIG)
    mode[6][termios.VMIN] = 1
    mode[6][termios.VTIME] = 0
    termios.tcsetattr(fd, termios.TCSAFLUSH, mode)
    try:
        yield
    finally:
        with contextlib.suppress(termios.error):
            termios.tcsetattr(fd, termios.TCSAFLUSH, saved)


def caller_size(fds: tuple[int, int, int]) -> tuple[int, int] | None:
    """The window size of the caller's terminal (its stdin's, else its stdout's)."""
    return size_of(fds[0]) or size_of(fds[1])


@contextlib.contextmanager
def caller_terminal(resize: Callable[[tuple[int, int]], None] | None, fds: tuple[int, int, int]) -> Iterator[None]:
    """In the process that holds the caller's terminal (the CLI in-process), for an exec with a
    terminal of its own (`resize` sets that one's window size): the caller's in raw mode, and
    each change of its window size (SIGWINCH) given to the exec's. Nothing for an exec without
    one (`resize` None)."""
    if resize is None:
        yield
        return

    def resized(_signum: int, _frame: object) -> None:
        size = caller_size(fds)
        if size is not None:
            resize(size)

    previous = signal.signal(signal.SIGWINCH, resized)
    try:
        with raw(fds[0]):
            yield
    finally:
        signal.signal(signal.SIGWINCH, previous)


def winch_message(size: tuple[int, int]) -> bytes:
    """What a CLI client sends the service when its window size changes."""
    return bytes([WINCH_MESSAGE]) + WINCH_SIZE.pack(*size)
