"""`put` and `get`: files and directories into and out of a sandbox, as tar streams over exec.

Both go through the sandbox's own exec, so the sandbox user reads and writes them inside, with
every confinement an exec has; the host side is the caller's own process. `put` streams a tar
that a thread of the caller's process makes of a local path into the sandbox's `tar -x`; `get`
reads the stream the sandbox's `tar -c` writes as it comes and unpacks only what it must be:
regular files and directories below the one name asked for — no links, devices or paths
outside it, no setuid bits — into a destination that did not exist (removed again when the copy
fails). Neither holds a copy whole in memory. Used by the embedded `Sandbox` and by the
service's `ClientSandbox` alike.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import shutil
import tarfile
import threading
from collections.abc import Callable, Iterator

from sandboxer.api.results import ExecResult, OutputStream
from sandboxer.errors import UsageError

Exec = Callable[..., ExecResult]  # a sandbox's exec(argv, *, stdin=...)
ExecStream = Callable[..., OutputStream]  # a sandbox's exec_stream(argv)
MAX_STDERR = 4096  # of the sandbox's tar, kept for the error message


def _inside(path: str, what: str) -> tuple[str, str]:
    """(parent, name) of an absolute, normalized path inside the sandbox."""
    if not path.startswith("/") or posixpath.normpath(path) != path or path == "/" or "\0" in path:
        raise UsageError(f"{what}: {path!r} must be a normalized absolute path inside the sandbox, other than /")
    return posixpath.split(path)


def put(run: Exec, source: str, destination: str) -> None:
    """Copy the local file or directory `source` to `destination` inside the sandbox. A copy that
    fails part of the way may leave part of it inside."""
    parent, name = _inside(destination, "put")
    if not os.path.lexists(source):
        raise UsageError(f"put: {source}: no such file or directory")
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    failure: list[OSError] = []

    def pack() -> None:
        try:
            with (
                os.fdopen(write_end, "wb") as pipe,
                tarfile.open(fileobj=pipe, mode="w|", format=tarfile.PAX_FORMAT) as archive,
            ):
                archive.add(source, arcname=name, recursive=True)
        except OSError as exc:  # a local file it cannot read; or the sandbox's tar stopped reading
            failure.append(exc)

    packer = threading.Thread(target=pack, name="sandboxer-put", daemon=True)
    packer.start()
    try:
        with os.fdopen(read_end, "rb") as archive_stream:
            script = 'mkdir -p -- "$1" && exec tar -x -f - --no-same-owner -C "$1"'
            done = run(["sh", "-c", script, "put", parent], stdin=archive_stream)
    finally:
        packer.join()  # the pipe's read end is closed: a packer the sandbox stopped reading ends
    local = [exc for exc in failure if not isinstance(exc, BrokenPipeError)]
    if local:
        where = local[0].filename or source
        raise UsageError(f"put: {where}: cannot be read ({local[0].strerror or local[0]})")
    if done.status != 0:
        raise UsageError(f"put: {destination}: tar in the sandbox failed ({_first_line(done.stderr)})")


def get(run: ExecStream, source: str, destination: str) -> None:
    """Copy the file or directory `source` inside the sandbox to the new local `destination`."""
    parent, name = _inside(source, "get")
    if os.path.lexists(destination):
        raise UsageError(f"get: {destination}: exists; give a path that does not")
    output = _Stdout(run(["tar", "-c", "-f", "-", "-C", parent, "--", name]))
    made = _Made(destination)
    try:
        _unpack_all(output, source, name, made)
    except BaseException:
        output.stop()  # the sandbox's tar is killed
        made.remove()
        raise


class _Made:
    """The new local destination of a get: made by this get alone (never an existing path, even
    one that appeared meanwhile), so that a failed get removes it and nothing else."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.made = False

    def make(self, *, directory: bool, mode: int) -> None:
        """Make the destination itself, exclusively (FileExistsError if anything is there now)."""
        if directory:
            os.mkdir(self.path, 0o700)
            os.chmod(self.path, mode | 0o700)
        else:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode))
        self.made = True

    def remove(self) -> None:
        if not self.made:
            return
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _unpack_all(output: _Stdout, source: str, name: str, made: _Made) -> None:
    """Unpack the sandbox's archive as it comes, member by member, then read to the exec's end."""
    try:
        with tarfile.open(fileobj=output, mode="r|") as archive:
            for member in archive:
                _unpack(member, archive, name, made)
    except tarfile.TarError:
        output.drain()
        if output.status == 0:
            raise UsageError(f"get: {source}: the sandbox sent a damaged archive") from None
    output.drain()
    if output.status != 0:
        raise UsageError(f"get: {source}: tar in the sandbox failed ({_first_line(bytes(output.stderr))})")


class _Stdout(io.RawIOBase):
    """A streamed exec's stdout as a file to read (its stderr kept aside, up to MAX_STDERR)."""

    def __init__(self, stream: OutputStream) -> None:
        self._stream = stream
        self._chunks: Iterator[tuple[str, bytes]] = iter(stream)
        self._pending = memoryview(b"")
        self.stderr = bytearray()

    @property
    def status(self) -> int | None:
        return self._stream.status

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._pending:
            item = next(self._chunks, None)
            if item is None:
                return 0
            kind, chunk = item
            if kind == "stdout":
                self._pending = memoryview(chunk)
            elif len(self.stderr) < MAX_STDERR:
                self.stderr += chunk[: MAX_STDERR - len(self.stderr)]
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def drain(self) -> None:
        """Read to the exec's end (its status is known then)."""
        scratch = bytearray(1 << 16)
        while self.readinto(scratch):
            pass

    def stop(self) -> None:
        """Stop reading: the exec is killed (leaving its stream early does that)."""
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


def _unpack(member: tarfile.TarInfo, archive: tarfile.TarFile, name: str, made: _Made) -> None:
    """One member of the sandbox's archive, created anew below the destination: a regular file or
    a directory below `name`, or the whole copy is refused."""
    path = posixpath.normpath(member.name)
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or parts[0] != name:
        raise UsageError(f"get: the sandbox's archive names {member.name[:80]!r}, outside {name}")
    if not (member.isfile() or member.isdir()):
        raise UsageError(f"get: {member.name[:80]!r} is not a regular file or directory; nothing is copied")
    target = os.path.join(made.path, *parts[1:])
    mode = member.mode & 0o755
    try:
        if not made.made:  # the destination itself, first of all
            made.make(directory=member.isdir() or len(parts) > 1, mode=mode if len(parts) == 1 else 0o700)
        if member.isdir():
            os.makedirs(target, mode=0o700, exist_ok=True)
            os.chmod(target, mode | 0o700)
            return
        if target != made.path:  # below it; the destination itself is in place (a bare "f" has no dirname to make)
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        anew = os.O_TRUNC if target == made.path else os.O_EXCL  # the destination file was made just now
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | anew
        out = os.fdopen(os.open(target, flags, mode), "wb")
    except OSError as exc:
        raise UsageError(f"get: {exc.filename or target}: cannot be written ({exc.strerror or exc})") from None
    stream = archive.extractfile(member)
    assert stream is not None  # a regular file  # noqa: S101
    written = 0
    with out:
        while chunk := stream.read(1 << 20):
            written += len(chunk)
            try:
                out.write(chunk)
            except OSError as exc:
                raise UsageError(f"get: {target}: cannot be written ({exc.strerror or exc})") from None
    if written != member.size:  # a stream read ends short without a word
        raise tarfile.ReadError("unexpected end of data")


def _first_line(data: bytes) -> str:
    line = data.decode(errors="replace").strip().splitlines()
    return line[0][:200] if line else "no message"
