"""Who a CLI command runs for, and with what: this process's own environment, directory and
stdio (the CLI in-process), or a CLI client's, which the service received over its socket.

The service runs the one command table for many clients at once, each in a worker thread: each
thread has its invocation (`current()`), and `sys.stdout`/`sys.stderr` are, in the service,
`ThreadStreams` that write to the current thread's client — so the commands, typer's help and
its usage errors print exactly as in-process. Nothing else in the broker is per-thread.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from sandboxer.api.caller import Caller
    from sandboxer.commands.services import Services
    from sandboxer.core.reading import CallerFile
    from sandboxer.dirs import Dirs


@dataclass(frozen=True, slots=True)
class Invocation:
    """One run of a command: its environment, working directory and stdio.

    `stdio` None is this process's own fds 0-2 (signals to this process reach the command);
    otherwise the descriptors a client passed, and `control` the client's connection: a signal
    it sends is the command's, and its end means the client went away.
    """

    environ: Mapping[str, str] = field(repr=False)  # values are the caller's, never shown
    cwd: str
    stdio: tuple[int, int, int] | None = None
    control: int | None = None
    caller: Caller | None = None  # the service's caller (the kernel's word); None: in-process
    dirs: Dirs | None = None  # the service's directories; None: in-process
    services: Services | None = None  # the service's engines and fills; None: in-process
    sandboxes: list[str] = field(default_factory=list)  # the sandbox the command named or made (audit)
    files: Mapping[str, CallerFile] = field(default_factory=dict)  # the client's opens, by the name given
    window: tuple[int, int] | None = None  # the client's terminal's (rows, columns), for exec -t


_local = threading.local()  # each thread's own: the command it runs


def current() -> Invocation:
    """The invocation of the command this thread runs (in-process: this process's)."""
    found: Invocation | None = getattr(_local, "invocation", None)
    if found is None:
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = "/"  # a removed working directory
        return Invocation(environ=os.environ, cwd=cwd)
    return found


@contextmanager
def running(invocation: Invocation, stdout: TextIO, stderr: TextIO) -> Iterator[None]:
    """Run a command of this thread for `invocation`, printing to `stdout` and `stderr`."""
    _local.invocation, _local.stdout, _local.stderr = invocation, stdout, stderr
    try:
        yield
    finally:
        _local.invocation = _local.stdout = _local.stderr = None


class ThreadStreams:
    """sys.stdout or sys.stderr of the service: the current thread's client's stream when it runs
    a command for one, else the service's own (its log)."""

    def __init__(self, name: str, own: TextIO) -> None:
        self._name = name
        self._own = own

    def _target(self) -> TextIO:
        stream: TextIO | None = getattr(_local, self._name, None)
        return self._own if stream is None else stream

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._target(), name)


def install_thread_streams() -> None:
    """Make sys.stdout and sys.stderr follow the current thread's invocation (the service)."""
    if not isinstance(sys.stdout, ThreadStreams):
        sys.stdout = ThreadStreams("stdout", sys.stdout)
        sys.stderr = ThreadStreams("stderr", sys.stderr)
