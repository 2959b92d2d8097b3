"""`put` and `get`: files and directories into and out of a sandbox, as tar streams over exec.

Both go through the sandbox's own exec, so the sandbox user reads and writes them inside, with
every confinement an exec has; the host side is the caller's own process. `put` sends a tar the
caller's process makes of a local path; `get` receives one the sandbox's `tar` makes, and
unpacks only what it must be: regular files and directories below the one name asked for —
no links, devices or paths outside it, no setuid bits — into a destination that did not exist.
Used by the embedded `Sandbox` and by the service's `ClientSandbox` alike.
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
from collections.abc import Callable, Sequence

from sandboxer.errors import UsageError
from sandboxer.results import ExecResult

Exec = Callable[..., ExecResult]  # a sandbox's exec(argv, *, stdin=...)


def _inside(path: str, what: str) -> tuple[str, str]:
    """(parent, name) of an absolute, normalized path inside the sandbox."""
    if not path.startswith("/") or posixpath.normpath(path) != path or path == "/" or "\0" in path:
        raise UsageError(f"{what}: {path!r} must be a normalized absolute path inside the sandbox, other than /")
    return posixpath.split(path)


def put(run: Exec, source: str, destination: str) -> None:
    """Copy the local file or directory `source` to `destination` inside the sandbox."""
    parent, name = _inside(destination, "put")
    if not os.path.lexists(source):
        raise UsageError(f"put: {source}: no such file or directory")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        archive.add(source, arcname=name, recursive=True)
    script = 'mkdir -p -- "$1" && exec tar -x -f - --no-same-owner -C "$1"'
    done = run(["sh", "-c", script, "put", parent], stdin=buffer.getvalue())
    if done.status != 0:
        raise UsageError(f"put: {destination}: tar in the sandbox failed ({_first_line(done.stderr)})")


def get(run: Exec, source: str, destination: str) -> None:
    """Copy the file or directory `source` inside the sandbox to the new local `destination`."""
    parent, name = _inside(source, "get")
    if os.path.lexists(destination):
        raise UsageError(f"get: {destination}: exists; give a path that does not")
    done = run(["tar", "-c", "-f", "-", "-C", parent, "--", name])
    if done.status != 0:
        raise UsageError(f"get: {source}: tar in the sandbox failed ({_first_line(done.stderr)})")
    try:
        with tarfile.open(fileobj=io.BytesIO(done.stdout), mode="r:") as archive:
            _unpack(archive.getmembers(), archive, name, destination)
    except tarfile.TarError:
        raise UsageError(f"get: {source}: the sandbox sent a damaged archive") from None


def _unpack(members: Sequence[tarfile.TarInfo], archive: tarfile.TarFile, name: str, destination: str) -> None:
    """Regular files and directories below `name`, created anew below `destination`."""
    for member in members:
        path = posixpath.normpath(member.name)
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or parts[0] != name:
            raise UsageError(f"get: the sandbox's archive names {member.name[:80]!r}, outside {name}")
        if not (member.isfile() or member.isdir()):
            raise UsageError(f"get: {member.name[:80]!r} is not a regular file or directory; nothing is copied")
    for member in members:
        target = os.path.join(destination, *posixpath.normpath(member.name).split("/")[1:])
        mode = member.mode & 0o755
        if member.isdir():
            os.makedirs(target, mode=0o700, exist_ok=True)
            os.chmod(target, mode | 0o700)
            continue
        os.makedirs(os.path.dirname(target) or ".", mode=0o700, exist_ok=True)
        stream = archive.extractfile(member)
        assert stream is not None  # a regular file  # noqa: S101
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "wb") as out:
            while chunk := stream.read(1 << 20):
                out.write(chunk)


def _first_line(data: bytes) -> str:
    line = data.decode(errors="replace").strip().splitlines()
    return line[0][:200] if line else "no message"
