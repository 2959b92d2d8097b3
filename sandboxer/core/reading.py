"""Reading the owner's and the callers' files safely: by descriptor, never through a symlink,
bounded, owner-only where that is the rule. The one kind of I/O the core does (docs/architecture.md);
the host and the commands open files below a directory with it too."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass


def open_dir_nofollow(path: str) -> int:
    """An O_PATH descriptor of the directory `path`, an absolute path walked from / one
    component at a time without following any symlink. Raises OSError."""
    parts = [part for part in path.split("/") if part]
    if not path.startswith("/") or any(part in (".", "..") for part in parts):
        raise OSError(errno.EINVAL, "not a clean absolute path", path)
    directory = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = inner
    except BaseException:
        os.close(directory)
        raise
    return directory


def open_beneath(root: str, path: str, flags: int = os.O_PATH, *, strict_root: bool = False) -> int:
    """Open `path`, which lies strictly below the directory `root`, following no symlink on the
    way (each component is opened relative to its parent with O_NOFOLLOW). `flags` apply to the
    last component; O_NOFOLLOW and O_CLOEXEC are always added. With `strict_root`, `root` itself
    is walked from / without following symlinks too (a path someone else controls). Raises OSError."""
    relative = os.path.relpath(path, root)
    parts = relative.split("/")
    if relative.startswith("..") or relative == "." or any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, "not below the directory", path)
    if strict_root:
        directory = open_dir_nofollow(root)
    else:
        directory = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)


class UnfitFile(Exception):
    """A file handed to the broker is not what it must be; `reason` says why, without content."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CallerFile:
    """A file its caller read for the broker — a service opens no path on another account's say-so.
    `path`: the absolute path the caller named (for messages only); then the descriptor the CLI
    client opened it on, or the bytes an API client read, or the errno of the client's open."""

    path: str
    fd: int | None = None
    data: bytes | None = None
    errno: int = 0


def read_owner_only(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """Read a file once: a regular file, not a symlink, with no group or other permission bits,
    at most `limit` bytes. Raises UnfitFile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UnfitFile(_unopened(exc.errno or errno.EIO)) from None
    try:
        return _read_owner_only(fd, limit)
    finally:
        os.close(fd)


def read_caller_file(source: str | CallerFile, limit: int) -> bytes:
    """read_owner_only of a path, or of a file its caller read: its descriptor is checked the
    same way (the client opened it without following a symlink); bytes sent have no mode to
    check, only their size."""
    if isinstance(source, str):
        return read_owner_only(source, limit)[0]
    if source.data is not None:
        if len(source.data) > limit:
            raise UnfitFile(f"is larger than {limit} bytes")
        return source.data
    if source.fd is None:
        raise UnfitFile(_unopened(source.errno))
    return _read_owner_only(source.fd, limit)[0]


def _unopened(number: int) -> str:
    if number == errno.ELOOP:
        return "is a symlink"
    try:
        reason = os.strerror(number)
    except (OverflowError, ValueError):
        reason = f"error {number}"
    return f"cannot be read ({reason})"


def _read_owner_only(fd: int, limit: int) -> tuple[bytes, os.stat_result]:
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnfitFile("must be a regular file")
        if info.st_mode & 0o077:
            raise UnfitFile("must be owner-only (no group or other permissions)")
        chunks, size = [], 0
        while chunk := os.pread(fd, 65536, size):  # pread: a caller's descriptor is read from its start
            size += len(chunk)
            if size > limit:
                raise UnfitFile(f"is larger than {limit} bytes")
            chunks.append(chunk)
    except OSError as exc:  # a caller's descriptor not open for reading, say
        raise UnfitFile(_unopened(exc.errno or errno.EIO)) from None
    return b"".join(chunks), info
