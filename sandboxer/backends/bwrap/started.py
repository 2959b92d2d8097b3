"""An exec started in a bwrap sandbox (sandboxer.backends.bwrap.joiner): its relay A and its
command B, and how its end is waited for — A as this process's child, or A forked by the
service's spawner (sandboxer.backends.bwrap.spawner), which writes B's status to a pipe.
"""

from __future__ import annotations

import os
import signal


class Started:
    """A command started in a sandbox: A (the relay) and B (the command, host pid). `status_fd`:
    where A writes B's exit status before it ends, when A is not this process's child (a
    spawner's: sandboxer.backends.bwrap.spawner) and so cannot be waited for here."""

    __slots__ = ("command_pid", "ended", "lost", "pidfd", "relay_pid", "status_fd")

    def __init__(self, *, relay_pid: int, command_pid: int, status_fd: int | None = None) -> None:
        self.relay_pid = relay_pid
        self.command_pid = command_pid
        self.status_fd = status_fd
        self.pidfd: int | None = None
        self.lost = False  # the relay ended without the command's status
        self.ended: int | None = None  # the status finish() found (it waits once)

    def ended_fd(self) -> int:
        """A descriptor readable once the relay ended: the status pipe of a spawner's relay (A
        writes before it ends, or ends killed: end of file); else a pidfd of this process's child.
        finish() closes it."""
        if self.status_fd is not None:
            return self.status_fd
        if self.pidfd is None:
            self.pidfd = os.pidfd_open(self.relay_pid)
        return self.pidfd

    def finish(self) -> int:
        """Wait for the relay to end (once; later calls give the same): the command's exit status
        (128+N for signal N; 137 when the relay itself was killed before it could say)."""
        if self.ended is None:
            self.ended = self._wait()
        return self.ended

    def _wait(self) -> int:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.status_fd is None:
            while True:
                try:
                    _, status = os.waitpid(self.relay_pid, 0)
                    break
                except InterruptedError:
                    continue
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        status_fd, self.status_fd = self.status_fd, None
        try:
            while True:  # A writes its few bytes at once, or ends without them (end of file)
                try:
                    said = os.read(status_fd, 16).strip()
                    break
                except InterruptedError:
                    continue
        finally:
            os.close(status_fd)
        if said.isdigit() and len(said) < 4:
            return int(said)
        self.lost = True  # the relay was killed (its spawner gone, say): the command may live on
        return 128 + signal.SIGKILL

    def close(self) -> None:
        """Give up on the status (the caller already knows how the exec ended)."""
        for fd in (self.status_fd, self.pidfd):
            if fd is not None:
                os.close(fd)
        self.status_fd = self.pidfd = None
