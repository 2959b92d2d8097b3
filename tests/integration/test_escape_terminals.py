"""Escape probes: terminals. CVE-2017-5226 (bubblewrap) let a sandboxed process push keystrokes
into the caller's terminal with TIOCSTI, run by the caller's shell once the sandbox exits.

The caller hands the exec a pseudo-terminal as its stdin, in two shapes: a pty that is no
session's controlling terminal (`pty.openpty()` in the test), and the caller's own controlling
terminal (the CLI runs under `setsid --ctty` with the pty as stdin). Inside, the command is a
session leader without a controlling terminal, and the syscall policy refuses TIOCSTI and
TIOCLINUX whatever the terminal (the kernel reads the low 32 bits of the request, and so does the
policy). After each exec the test reads the terminal from both ends: not one byte was injected.
The control injects from the test itself (root may TIOCSTI any terminal) and sees the byte
arrive, so the check can see an injection when there is one.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import termios

import pytest

from tests.integration.test_escape_support import PRELUDE, SYSTEM_PYTHON, Box, answer, box_fixture

box = box_fixture()

TIOCLINUX = 0x541C
INJECTED = b"Z"

# ioctl(fd, request, arg) → "ok" or the errno name; the request as a full 64-bit value.
IOCTL = r"""
import termios
_libc.ioctl.restype = ctypes.c_int
def ioctl(fd, request, arg):
    ctypes.set_errno(0)
    result = _libc.ioctl(fd, ctypes.c_ulong(request), arg)
    return "ok" if result >= 0 else name(ctypes.get_errno())
char = ctypes.c_char(b"Z")
"""


def pending(fd: int) -> bytes:
    """What can be read from `fd` right now (non-blocking, nothing if nothing)."""
    data = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def raw_pty() -> tuple[int, int]:
    """A pty pair in non-canonical mode without echo: an injected byte is readable at once on the
    slave side and nothing is echoed to the master."""
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~(termios.ICANON | termios.ECHO)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    return master, slave


def run_on_pty(box: Box, code: str, *, controlling: bool) -> tuple[str, bytes]:
    """Run a probe with a pty as stdin — an orphan pty, or the caller's controlling terminal;
    returns what the probe printed and every byte found on the terminal afterwards."""
    master, slave = raw_pty()
    try:
        argv = box.broker.argv("exec", box.sandbox_id, "--", SYSTEM_PYTHON, "-c", PRELUDE + IOCTL + code)
        if controlling:
            argv = ["setsid", "--ctty", "--wait", *argv]
        proc = subprocess.run(argv, stdin=slave, capture_output=True, env=box.broker.env(), check=False, timeout=120)
        typed = pending(slave) + pending(master)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode().strip(), typed


def test_control_the_terminal_check_sees_an_injection() -> None:
    master, slave = raw_pty()
    try:
        fcntl.ioctl(slave, termios.TIOCSTI, INJECTED)
        typed = pending(slave) + pending(master)
    finally:
        os.close(slave)
        os.close(master)
    assert INJECTED in typed


SHAPES = [pytest.param(False, id="orphan-pty"), pytest.param(True, id="controlling-tty")]

REQUESTS = [
    pytest.param("ioctl(0, termios.TIOCSTI, ctypes.byref(char))", id="tiocsti"),
    pytest.param("ioctl(0, termios.TIOCSTI | (1 << 32), ctypes.byref(char))", id="tiocsti-high-bits"),
    pytest.param(f"ioctl(0, {TIOCLINUX}, ctypes.byref(ctypes.c_char(2)))", id="tioclinux"),
    pytest.param(f"ioctl(0, {TIOCLINUX} | (0xFFFF << 32), ctypes.byref(ctypes.c_char(3)))", id="tioclinux-high-bits"),
]


@pytest.mark.parametrize("controlling", SHAPES)
@pytest.mark.parametrize("request_expression", REQUESTS)
def test_no_keystroke_reaches_the_callers_terminal(box: Box, controlling: bool, request_expression: str) -> None:
    printed, typed = run_on_pty(box, f"print({request_expression})", controlling=controlling)
    assert (printed, typed) == ("EPERM", b"")


def test_orphan_pty_made_controlling_still_takes_no_keystroke(box: Box) -> None:
    """The exec is a session leader, but the caller's pty never reaches it: both backends hand
    the command a pipe (bwrap's broker copies the terminal through it), so TIOCSCTTY is ENOTTY,
    and TIOCSTI is refused by the policy before the kernel looks at the descriptor."""
    code = "print(ioctl(0, termios.TIOCSCTTY, 0), ioctl(0, termios.TIOCSTI, ctypes.byref(char)))"
    printed, typed = run_on_pty(box, code, controlling=False)
    assert (printed, typed) == ("ENOTTY EPERM", b"")


def test_callers_controlling_terminal_cannot_be_taken(box: Box) -> None:
    """TIOCSCTTY on the caller's terminal (the command has a pipe, never the terminal itself) and
    /dev/tty (the exec has no controlling terminal) are refused."""
    code = "print(ioctl(0, termios.TIOCSCTTY, 1), try_open('/dev/tty', os.O_RDWR))"
    printed, typed = run_on_pty(box, code, controlling=True)
    assert (printed, typed) == ("ENOTTY ENXIO", b"")


def test_exec_is_its_own_session_without_a_terminal(box: Box) -> None:
    code = "print(os.getsid(0) == os.getpid(), try_open('/dev/tty', os.O_RDWR))"
    printed, typed = run_on_pty(box, code, controlling=True)
    assert (printed, typed) == ("True ENXIO", b"")


def test_vhangup_is_refused(box: Box) -> None:
    printed, typed = run_on_pty(box, "print(syscall(153))", controlling=True)
    assert (printed, typed) == ("EPERM", b"")


def test_tiocsti_on_a_pty_made_inside_is_refused(box: Box) -> None:
    """The policy refuses TIOCSTI on every terminal, one the exec opened itself included."""
    code = "master, slave = os.openpty()\nprint(ioctl(slave, termios.TIOCSTI, ctypes.byref(char)))"
    assert answer(box.py(IOCTL + code)) == "EPERM"


@pytest.mark.parametrize("device", ["/dev/console", "/dev/tty0", "/dev/tty1", "/dev/vcs", "/dev/vcsa"])
def test_no_console_device(box: Box, device: str) -> None:
    assert answer(box.py(f"print(try_open({device!r}, os.O_RDWR))")) == "ENOENT"
