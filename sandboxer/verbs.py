"""What a sandbox offers whichever way it is reached — in-process (`sandboxer.api.Sandbox`) or
through the service (`sandboxer.client.ClientSandbox`): its id and what create reported, teardown
at the end of a `with` block, and put/get on top of its own exec."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import BinaryIO, Self

from sandboxer.results import Created, ExecResult, Exported, OutputStream, Receipt

# An exec's stdin: all of it, or a binary file read to its end as the command runs (a pipe, a
# file, a socket: put's tar stream).
Stdin = bytes | BinaryIO


def checked_signal(signum: int) -> int:
    """`signum` when a caller may send it to an exec's command (SIGINT, SIGTERM, SIGHUP: what a
    CLI client passes on), else UsageError (2)."""
    from sandboxer.errors import UsageError
    from sandboxer.host.stdio import FORWARDED

    if signum not in FORWARDED:
        raise UsageError(f"signal: {signum} is not one an exec's command may be sent (SIGINT, SIGTERM or SIGHUP)")
    return signum


class InputChunks:
    """A caller's binary file as an exec's input: its chunks as they come, until its end or until
    stop(). A file with a descriptor is read from the descriptor (not through the file object's
    buffer), and stop() ends a wait on it at once; one without (BytesIO) by its read(). Why a
    read failed is kept in `failure`, for the caller's thread to raise."""

    def __init__(self, stdin: BinaryIO) -> None:
        self._stdin = stdin
        try:
            self._fd: int | None = stdin.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
            self._fd = None
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self.failure: BaseException | None = None

    def __iter__(self) -> Iterator[bytes]:
        from sandboxer.host.ready import wait_ready

        read = getattr(self._stdin, "read1", self._stdin.read)  # what is there, as it comes
        while True:
            try:
                if self._fd is None:
                    chunk = read(1 << 16)
                elif self._stop_r in wait_ready([self._fd, self._stop_r])[0]:
                    return
                else:
                    chunk = os.read(self._fd, 1 << 16)
            except Exception as exc:  # the caller's file: raised in the caller's thread
                self.failure = exc
                return
            if not chunk:
                return
            yield chunk

    def stop(self) -> None:
        """No more reading: a wait on the descriptor ends now."""
        os.write(self._stop_w, b"x")

    def close(self) -> None:
        os.close(self._stop_r)
        os.close(self._stop_w)


class SandboxBase:
    """The verbs both kinds of sandbox share; each implements exec_stream and teardown its own way."""

    def __init__(self, created: Created | None, sandbox_id: str | None) -> None:
        self.created = created  # what create reported; None for a sandbox looked up by id
        self.id: str = created.id if created is not None else str(sandbox_id)
        self._receipt: Receipt | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.teardown(discard=True)  # the block is the sandbox's scope: export inside it what is to stay

    def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` in the sandbox and wait for it: its status and all of its output."""
        stream = self.exec_stream(
            argv, stdin=stdin, cwd=cwd, timeout=timeout, consumer=consumer, executable=executable, env=env
        )
        out: list[bytes] = []
        err: list[bytes] = []
        for name, chunk in stream:
            (out if name == "stdout" else err).append(chunk)
        return ExecResult(status=int(stream.status or 0), stdout=b"".join(out), stderr=b"".join(err))

    def exec_stream(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> OutputStream:
        """Run `argv` and yield its output as it arrives; `.status` once the iteration ended."""
        raise NotImplementedError

    def teardown(self, *, discard: bool = False) -> Receipt:
        """Remove the sandbox; later calls return the same receipt. Work no export took out
        (new commits, changes not committed) refuses it (UnexportedWorkError, 2) unless
        `discard`."""
        raise NotImplementedError

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination`: "bundle" (its new commits
        as a Git bundle), "patch" (as a patch series, in a new or empty directory) or "tar" (its
        working tree). Verified on the host before it is written; teardown then loses nothing
        of it."""
        raise NotImplementedError

    def put(self, source: str, destination: str) -> None:
        """Copy the local file or directory `source` to `destination` (an absolute path) inside
        the sandbox, as its user (sandboxer.transfer)."""
        from sandboxer.transfer import put

        self._require_known()
        put(self.exec, source, destination)

    def get(self, source: str, destination: str) -> None:
        """Copy the file or directory `source` inside the sandbox to the new local `destination`:
        regular files and directories only (sandboxer.transfer)."""
        from sandboxer.transfer import get

        self._require_known()
        get(self.exec_stream, source, destination)

    def _require_known(self) -> None:
        """NotFoundError (4) when the broker has no such sandbox (any more): put and get say so
        as cp does, not as the exec they run would (125)."""
        raise NotImplementedError
