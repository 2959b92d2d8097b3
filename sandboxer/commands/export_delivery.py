"""Delivering an export to its caller: to a path of the caller's own process (the embedded API,
the CLI in-process, the HTTP client), to descriptors a CLI client opened with its own rights and
passed to the service, or as one byte stream (the HTTP API's body). Each makes only new files,
never through a link, and leaves nothing of the export behind when it fails.

A bundle or a tree's tar is one file; a patch series is files named NNNN-subject.patch in a new
or empty directory (through HTTP, a tar of them, unpacked here by that rule only).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tarfile
from collections.abc import Iterable, Iterator
from typing import IO

from sandboxer.commands.export import Export
from sandboxer.errors import BackendError, UsageError
from sandboxer.host.fsutil import write_all

CHUNK = 1024 * 1024
PATCH_NAME = re.compile(r"[0-9]{4}-[A-Za-z0-9._-]{1,60}\.patch")
MAX_PATCH = 256 * 1024 * 1024  # one patch file received through HTTP


def deliver_to_path(export: Export, destination: str) -> None:
    """Write a verified export at `destination` (sandboxer.verbs's rules)."""
    if export.format == "patch":
        write_series_at(destination, _series(export))
    else:
        write_file_at(destination, _chunks_of(export.files[0][1]))


def deliver_to_file(export: Export, fd: int, shown: str) -> None:
    """Copy a bundle's or a tar's bytes to `fd` (a new, empty file a CLI client opened)."""
    _write_file(fd, _chunks_of(export.files[0][1]), shown)


def deliver_to_directory(export: Export, directory: int, shown: str, *, owner: tuple[int, int] | None) -> None:
    """Write a patch series into the empty directory `directory` a CLI client opened; `owner`
    (uid, gid) is given the files a root service writes for another account."""
    _write_series(directory, _series(export), shown, owner=owner)


def stream_of(export: Export) -> Iterator[bytes]:
    """The export as one byte stream (the HTTP API's body): a bundle's or a tar's bytes; a patch
    series as a tar of its files."""
    if export.format != "patch":
        yield from _chunks_of(export.files[0][1])
        return
    archive_path = os.path.join(export.directory, "patches.tar")
    with tarfile.open(archive_path, "w", format=tarfile.PAX_FORMAT) as archive:
        for name, source in export.files:
            info = tarfile.TarInfo(name)
            info.size = os.stat(source).st_size
            info.mode = 0o644
            with open(source, "rb") as stream:
                archive.addfile(info, stream)
    yield from _chunks_of(archive_path)


def receive(fmt: str, body: IO[bytes], destination: str) -> None:
    """What stream_of sent, written at `destination` (the HTTP client's side)."""
    if fmt != "patch":
        write_file_at(destination, iter(lambda: body.read(CHUNK), b""))
        return
    write_series_at(destination, _unpacked(body))


def write_file_at(destination: str, chunks: Iterable[bytes]) -> None:
    """A new file at `destination` with `chunks`; removed again when writing fails."""
    try:
        fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise UsageError(f"export: {destination}: cannot be created ({exc.strerror})") from None
    try:
        _write_file(fd, chunks, destination)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(destination)
        raise
    finally:
        os.close(fd)


def write_series_at(destination: str, series: Iterable[tuple[str, bytes]]) -> None:
    """The patch files in `destination`, a new or empty directory (made here when missing, and
    removed again when writing fails)."""
    made = False
    try:
        os.mkdir(destination, 0o777)
        made = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"export: {destination}: cannot be created ({exc.strerror})") from None
    try:
        directory = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"export: {destination}: must be a directory ({exc.strerror})") from None
    try:
        _write_series(directory, series, destination, owner=None)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(destination)
        raise
    finally:
        os.close(directory)


def _write_file(fd: int, chunks: Iterable[bytes], shown: str) -> None:
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != 0:
            raise UsageError(f"export: {shown}: must be a new, empty file")
        for chunk in chunks:
            write_all(fd, chunk)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        raise UsageError(f"export: {shown}: cannot be written ({exc.strerror})") from None


def _write_series(
    directory: int, series: Iterable[tuple[str, bytes]], shown: str, *, owner: tuple[int, int] | None
) -> None:
    """Each (name, bytes) as a new file in the empty `directory`; what was written is removed
    again when this fails."""
    written: list[str] = []
    try:
        with os.scandir(directory) as entries:
            if any(True for _ in entries):
                raise UsageError(f"export: {shown}: must be a new or empty directory")
        for name, data in series:
            if not PATCH_NAME.fullmatch(name):
                raise BackendError(f"export: {name[:80]!r} is not a patch file's name")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=directory)
            written.append(name)
            try:
                if owner is not None:
                    os.fchown(fd, *owner)
                write_all(fd, data)
            finally:
                os.close(fd)
    except BaseException as exc:
        for name in written:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=directory)
        if isinstance(exc, OSError):
            raise UsageError(f"export: {shown}: cannot be written ({exc.strerror})") from None
        raise


def _series(export: Export) -> Iterator[tuple[str, bytes]]:
    for name, source in export.files:
        with open(source, "rb") as stream:
            yield name, stream.read()


def _unpacked(body: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """The patch files of a tar stream: regular files with patch names only."""
    try:
        with tarfile.open(fileobj=body, mode="r|") as archive:
            for member in archive:
                if member.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
                    continue
                if not member.isfile() or not PATCH_NAME.fullmatch(member.name) or member.size > MAX_PATCH:
                    raise BackendError(f"export: the service sent {member.name[:80]!r}, which is not a patch file")
                stream = archive.extractfile(member)
                if stream is None:
                    raise BackendError(f"export: {member.name[:80]!r} cannot be read")
                yield member.name, stream.read()
    except tarfile.TarError as exc:
        raise BackendError(f"export: the service's patch series cannot be read ({exc})") from None


def _chunks_of(path: str) -> Iterator[bytes]:
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            yield chunk
