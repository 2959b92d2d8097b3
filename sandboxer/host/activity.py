"""When a sandbox was last used, for a profile's idle timeout (`lifetime.idle_seconds`).

Each sandbox has a file `active` in its directory, made with it. An exec holds a shared lock on
it while it runs and touches it when it starts and ends; so the service knows a sandbox is idle
when it can take the lock exclusively and the file's time is older than the timeout. A sandbox
without the file (made before it existed) is never idle.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

FILE = "active"


def prepare(directory: str) -> None:
    """Make the sandbox's activity file (now is its last use)."""
    fd = os.open(os.path.join(directory, FILE), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.utime(fd)  # a warm sandbox taken now: its use starts now
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_use(directory: str) -> Iterator[None]:
    """While an exec runs: the sandbox is in use, and was used when it started and ended."""
    try:
        fd = os.open(os.path.join(directory, FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield  # an older sandbox, or one going away: nothing to track
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.utime(fd)
        os.close(fd)


def idle_seconds(directory: str, now: float) -> float | None:
    """How long the sandbox has been unused; None while an exec runs or when it is not tracked."""
    try:
        fd = os.open(os.path.join(directory, FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        return now - os.fstat(fd).st_mtime
    finally:
        os.close(fd)
