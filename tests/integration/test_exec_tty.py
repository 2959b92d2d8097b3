"""`exec -t`: an interactive shell in a terminal of the exec's own, driven from a pseudo-terminal
the test holds as a person's terminal would be — in-process and through the service, on every
backend. The command's terminal is never the caller's: it has its own window size (and its
changes), job control works in `bash -i`, TIOCSTI is refused, and the caller's terminal modes
are as they were afterwards."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Iterator

import pytest

from tests.integration.conftest import SandboxBroker
from tests.integration.services import Service


class Terminal:
    """A pseudo-terminal the CLI runs on, as on a person's terminal (its controlling one)."""

    def __init__(self, rows: int, columns: int) -> None:
        self.master, self.end = os.openpty()
        self.resize(rows, columns)
        self.seen = b""

    def resize(self, rows: int, columns: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def read_until(self, marker: bytes, seconds: float = 20) -> bytes:
        deadline = time.monotonic() + seconds
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"{marker!r} never came: {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # the far end closed
                    break
        return self.seen

    def type(self, line: str) -> None:
        """Type a line (a test's marker in it is computed by the shell: `echo x-$((1+1))` is
        seen as x-2 only once the shell ran it, never in the line's own echo)."""
        os.write(self.master, line.encode() + b"\n")


def _as_controlling_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.fixture(params=["in-process", "service"])
def front(request: pytest.FixtureRequest, sbx: SandboxBroker) -> Iterator[dict[str, str]]:
    """The CLI's environment for the front: in-process, or through a service (a root broker's
    own; an unprivileged user's client starts its private one)."""
    env = {k: v for k, v in sbx.env().items() if k != "SANDBOXER_NO_SERVICE"} | {"TERM": "xterm-256color"}
    if request.param == "in-process":
        yield env | {"SANDBOXER_NO_SERVICE": "1"}
        return
    if sbx.as_user:
        yield env
        return
    service = Service(sbx, sbx.state / "broker.sock").start()
    try:
        yield env
    finally:
        service.stop()


def test_an_interactive_shell_in_a_terminal_of_its_own(sbx: SandboxBroker, front: dict[str, str]) -> None:
    sandbox_id = sbx.create()
    terminal = Terminal(30, 100)
    before = termios.tcgetattr(terminal.end)
    process = subprocess.Popen(
        sbx.argv("exec", "-t", sandbox_id, "--", "bash", "--norc", "--noprofile", "-i"),
        stdin=terminal.end,
        stdout=terminal.end,
        stderr=terminal.end,
        env=front,
        start_new_session=True,
        preexec_fn=_as_controlling_terminal,  # noqa: PLW1509 - the test's stand-in for a login's terminal
    )
    try:
        terminal.read_until(b"$ ")
        terminal.type("test -t 0 && test -t 1 && echo IS-A-TERMINAL; stty size; echo TERM=$TERM; echo one-$((10+1))")
        seen = terminal.read_until(b"one-11\r\n")
        assert b"IS-A-TERMINAL" in seen
        assert b"30 100" in seen
        assert b"TERM=xterm-256color" in seen
        # The terminal is the sandbox's own device: it has a name there, and the command can
        # open it again by that name (as script, ssh's and gpg's prompts do).
        reopen = "import os; n = os.ttyname(0); os.close(os.open(n, os.O_RDWR)); print('named', n)"
        terminal.type(f'tty; python3 -c "{reopen}"; echo four-$((40+4))')
        seen = terminal.read_until(b"four-44\r\n")
        assert b"not a tty" not in seen
        assert re.search(rb"\r\nnamed /dev/pts/\d+\r\n", seen), seen[-600:]
        terminal.type("script -qc 'tty; echo in-script-$((2+3))' /dev/null; echo five-$((50+5))")
        seen = terminal.read_until(b"five-55\r\n")
        assert b"in-script-5" in seen, seen[-600:]
        terminal.resize(40, 120)
        time.sleep(0.5)  # the caller's SIGWINCH, passed on
        terminal.type("stty size; sleep 60 & jobs; kill %1; echo two-$((20+2))")
        seen = terminal.read_until(b"two-22\r\n")
        assert b"40 120" in seen
        assert b"Running" in seen  # job control: a background job of the shell's own
        assert b"no job control" not in seen
        script = "import fcntl, termios; fcntl.ioctl(0, termios.TIOCSTI, b'x')"
        terminal.type(f'python3 -c "{script}" 2>&1 | tail -1; echo three-$((30+3))')
        seen = terminal.read_until(b"three-33\r\n")
        assert b"PermissionError: [Errno 1] Operation not permitted" in seen
        terminal.type("exit 7")
        assert process.wait(timeout=30) == 7
        assert termios.tcgetattr(terminal.end) == before  # raw mode undone
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(terminal.master)
        os.close(terminal.end)


def test_exec_without_t_keeps_the_command_off_any_terminal(sbx: SandboxBroker) -> None:
    sandbox_id = sbx.create()
    plain = sbx.exec(sandbox_id, "sh", "-c", "test -t 0 || test -t 1 && echo TERMINAL; echo T=${TERM-unset}")
    assert (plain.status, plain.stdout) == (0, "T=unset\n"), plain.stderr


def test_exec_t_ends_when_its_piped_input_does(sbx: SandboxBroker) -> None:
    """Input from a pipe, not a terminal: its end reaches the command's terminal as end of file
    (^D), so a command reading it ends when the input does."""
    sandbox_id = sbx.create()
    done = subprocess.run(
        sbx.argv("exec", "-t", sandbox_id, "--", "sh", "-c", "cat; echo after-$((40+2))"),
        input=b"fed\n",
        capture_output=True,
        env=sbx.env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(b"fed") >= 1
    assert b"after-42" in done.stdout
