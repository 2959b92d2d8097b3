"""What a sandbox offers whichever way it is reached — in-process (`sandboxer.api.broker.Sandbox`) or
through the service (`sandboxer.clients.service.ClientSandbox`): its id and what create reported, teardown
at the end of a `with` block, and put/get on top of its own exec."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import BinaryIO, Self, cast

from sandboxer.api.results import Created, ExecResult, Exported, OutputStream, Receipt
from sandboxer.api.transfer import get, put
from sandboxer.api.usage_results import Lifetime, Usage, WorkSummary
from sandboxer.errors import ExecError, UsageError
from sandboxer.execio.stdio import FORWARDED
from sandboxer.host.ready import wait_ready

# An exec's stdin as a program gives it: all of it (bytes-like), or a binary file read to its end
# as the command runs (a pipe, a file, a socket: put's tar stream).
Input = bytes | bytearray | memoryview | BinaryIO
# ... and as the front ends pass it on, once checked_exec has made bytes-like input bytes.
Stdin = bytes | BinaryIO
# A local path, or one inside a sandbox: a str or a pathlib path.
PathArg = str | os.PathLike[str]


def checked_exec(
    argv: object, stdin: object, *, cwd: object, timeout: object, consumer: object, executable: object, env: object
) -> tuple[list[str], Stdin]:
    """An exec's argv and stdin as the front ends pass them on, once every argument is of its
    type. A Python mistake is TypeError before anything starts: a str as argv would run a program
    named by its first character, a str as stdin would leave a service's exec waiting for input
    that never comes (docs/api.md, "Arguments")."""
    if isinstance(argv, str | bytes | bytearray | memoryview) or not isinstance(argv, Sequence):
        raise TypeError(f'exec: argv must be a list of str, one per argument (["ls", "-la"]), not {_kind(argv)}')
    for arg in argv:
        _require("exec: each argument in argv", arg, (str,), "a str")
    if not argv:  # the broker's refusal, as the CLI's `exec ID --` (before anything is sent)
        raise ExecError("exec: no command")
    for name, value in (("cwd", cwd), ("consumer", consumer), ("executable", executable)):
        _require(f"exec: {name}", value, (str, type(None)), "a str or None")
    _require("exec: timeout", timeout, (int, float, type(None)), "a number of seconds (int or float) or None")
    _require("exec: env", env, (Mapping, type(None)), "a mapping of str to str or None")
    if isinstance(env, Mapping):
        for name, value in env.items():
            _require("exec: env's names", name, (str,), "str")
            _require(f"exec: env[{name!r}]", value, (str,), "a str")
    return list(argv), _checked_stdin(stdin)


def _checked_stdin(stdin: object) -> Stdin:
    """bytes-like input as bytes, a binary file as it is; TypeError for text (str or a text file)."""
    if isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, bytearray | memoryview):
        return bytes(stdin)
    if isinstance(stdin, str):
        raise TypeError("exec: stdin must be bytes or a binary file, not str: encode it (text.encode())")
    # A text file has an encoding (io.TextIOWrapper, and a tempfile wrapper around one); a binary one has none.
    if isinstance(stdin, io.TextIOBase) or isinstance(getattr(stdin, "encoding", None), str):
        raise TypeError(f'exec: stdin must be bytes or a binary file, not a text file ({_kind(stdin)}): open it "rb"')
    if not callable(getattr(stdin, "read", None)):
        raise TypeError(f'exec: stdin must be bytes or a binary file, not {_kind(stdin)} (no input: b"")')
    return cast(BinaryIO, stdin)


def checked_path(what: str, value: object) -> str:
    """`value` as a path: a str, or an os.PathLike of str (pathlib's) as its str; else TypeError
    (bytes too: every path the API takes is text)."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a path (a str or a pathlib path), not {_kind(value)}")
    return path


def checked_create(
    profile: object, *, manifest: object, bootstrap: object, ref: object, branch: object
) -> tuple[str | None, str | None]:
    """A create's manifest and bootstrap paths as str, once every argument is of its type; else
    TypeError (before anything is read or started)."""
    _require("create: profile", profile, (str,), "a profile's name (str)")
    # A ttl that is no number is the core's UsageError (2), with the very line the service gives.
    for name, value in (("ref", ref), ("branch", branch)):
        _require(f"create: {name}", value, (str, type(None)), "a str or None")
    return (
        None if manifest is None else checked_path("create: manifest", manifest),
        None if bootstrap is None else checked_path("create: bootstrap", bootstrap),
    )


def checked_export(what: str, format: object, destination: object) -> str:
    """An export's destination as str, once its format is a str and it is a path; else TypeError."""
    _require(f"{what}: format", format, (str,), 'a str ("bundle", "patch" or "tar")')
    return checked_path(f"{what}: destination", destination)


def check_dispatch(lease: object, request_id: object, wait_seconds: object) -> None:
    """TypeError for a dispatch_tool's argument not of its type."""
    _require("dispatch_tool: lease", lease, (str,), "a str")
    _require("dispatch_tool: request_id", request_id, (str,), "a str")
    _require("dispatch_tool: wait_seconds", wait_seconds, (int,), "a whole number of seconds (int)")


def _require(what: str, value: object, kinds: tuple[type, ...], expected: str) -> None:
    """TypeError unless `value` is one of `kinds`; a bool is never a number here. The message
    names the type, never the value (an argument may be a secret)."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"{what} must be {expected}, not {_kind(value)}")


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


def checked_signal(signum: int) -> int:
    """`signum` when a caller may send it to an exec's command (SIGINT, SIGTERM, SIGHUP: what a
    CLI client passes on), else UsageError (2)."""

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
        if created is None:
            _require("sandbox: the id", sandbox_id, (str,), "a str")
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
        stdin: Input = b"",
        cwd: str | None = None,
        timeout: float | None = None,
        consumer: str | None = None,
        executable: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run `argv` in the sandbox and wait for it: its status and all of its output."""
        stream = self.exec_stream(  # which checks the arguments first
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
        stdin: Input = b"",
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

    def usage(self) -> Usage:
        """What the running sandbox uses now: memory (now, peak), processes, CPU time, and the
        space its workspace, state and /tmp take (BackendError, 5, when it is not running)."""
        raise NotImplementedError

    def work_state(self) -> WorkSummary:
        """Its work as its git reports it now (commits since create, changes not committed), and
        what of it no export took out: what teardown would refuse for."""
        raise NotImplementedError

    def extend(self, seconds: int) -> Lifetime:
        """Its lifetime (create's ttl) ends `seconds` from now (never earlier than it did), within
        the profile's lifetime.max_seconds and a granted caller's max_ttl_seconds, both counted
        from its create (PolicyError, 3, past them)."""
        raise NotImplementedError

    def export(self, format: str, destination: str) -> Exported:
        """Take the sandbox's work out to the new local `destination`: "bundle" (its new commits
        as a Git bundle), "patch" (as a patch series, in a new or empty directory) or "tar" (its
        working tree). Verified on the host before it is written; teardown then loses nothing
        of it."""
        raise NotImplementedError

    def put(self, source: PathArg, destination: PathArg) -> None:
        """Copy the local file or directory `source` to `destination` (an absolute path) inside
        the sandbox, as its user (sandboxer.api.transfer)."""

        local, inside = checked_path("put: source", source), checked_path("put: destination", destination)
        self._require_known()
        put(self.exec, local, inside)

    def get(self, source: PathArg, destination: PathArg) -> None:
        """Copy the file or directory `source` inside the sandbox to the new local `destination`:
        regular files and directories only (sandboxer.api.transfer)."""

        inside, local = checked_path("get: source", source), checked_path("get: destination", destination)
        self._require_known()
        get(self.exec_stream, inside, local)

    def _require_known(self) -> None:
        """NotFoundError (4) when the broker has no such sandbox (any more): put and get say so
        as cp does, not as the exec they run would (125)."""
        raise NotImplementedError
