"""Delivering an export to its caller: to a path of the caller's own process (the embedded API,
the CLI in-process, the HTTP client), to descriptors a CLI client opened with its own rights and
passed to the service, or as one byte stream (the HTTP API's body). Each makes only new files,
never through a link, and leaves nothing of the export behind when it fails.

Whatever a caller names is written only as a regular file (or directory) of that caller's own,
checked on the open descriptor, on a filesystem made for files (FILE_SYSTEMS): never a file of
the kernel's (procfs, sysfs, cgroupfs...), where a write can be judged by the writer's rights —
a root service's — rather than by who opened it (sandboxer.commands.export_delivery.check_mine).

A bundle or a tree's tar is one file; a patch series is files named NNNN-subject.patch in a new
or empty directory (through HTTP, a tar of them, unpacked here by that rule only).
"""

from __future__ import annotations

import contextlib
import ctypes
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

# statfs(2) f_type of the filesystems an export may be written on: disks', networks' and memory's
# filesystems for files (linux/magic.h). Anything else — procfs, sysfs, cgroupfs, debugfs,
# tracefs, securityfs, configfs, bpffs, efivarfs... — is refused.
FILE_SYSTEMS = {
    0x0000EF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x52654973: "reiserfs",
    0x3153464A: "jfs",
    0x00003434: "nilfs2",
    0x0000482B: "hfsplus",
    0x00004D44: "vfat",
    0x2011BAB0: "exfat",
    0x5346544E: "ntfs",
    0x15013346: "udf",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
    0x65735546: "fuse",
    0x0000F15F: "ecryptfs",
    0x00006969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0x0BD00BD0: "lustre",
    0x5346414F: "afs",
}
KERNEL_FILE_SYSTEMS = {  # named in a refusal
    0x00009FA0: "procfs",
    0x62656572: "sysfs",
    0x0027E0EB: "cgroupfs",
    0x63677270: "cgroup2",
    0x64626720: "debugfs",
    0x74726163: "tracefs",
    0x73636673: "securityfs",
    0x62656570: "configfs",
    0xCAFE4A11: "bpffs",
    0xDE5E81E4: "efivarfs",
    0x00001CD1: "devpts",
}


def deliver_to_path(export: Export, destination: str) -> None:
    """Write a verified export at `destination` (sandboxer.api.verbs's rules)."""
    if export.format == "patch":
        write_series_at(destination, _series(export))
    else:
        write_file_at(destination, _chunks_of(export.files[0][1]))


def deliver_to_file(export: Export, fd: int, shown: str, *, uid: int) -> None:
    """Copy a bundle's or a tar's bytes to `fd`, which a CLI client opened: a new, empty file of
    its account `uid` (check_mine)."""
    check_mine(fd, shown, uid)
    _write_file(fd, _chunks_of(export.files[0][1]), shown)


def deliver_to_directory(
    export: Export, directory: int, shown: str, *, uid: int, owner: tuple[int, int] | None
) -> None:
    """Write a patch series into the empty directory `directory` a CLI client opened, one of its
    account `uid` (check_mine); `owner` (uid, gid) is given the files a root service writes for
    another account."""
    check_mine(directory, shown, uid, directory=True)
    _write_series(directory, _series(export), shown, owner=owner)


def check_mine(fd: int, shown: str, uid: int, *, directory: bool = False) -> None:
    """UsageError unless `fd` (opened without following a symlink) is a regular file — a
    directory with `directory` — of the account `uid`, on one of FILE_SYSTEMS."""
    what = "a directory" if directory else "a regular file"
    try:
        info = os.fstat(fd)
        kind = _fs_type(fd)
    except OSError as exc:
        raise UsageError(f"export: {shown}: cannot be written ({exc.strerror})") from None
    if not (stat.S_ISDIR if directory else stat.S_ISREG)(info.st_mode) or info.st_uid != uid:
        raise UsageError(f"export: {shown}: must be {what} of the caller's own")
    if kind not in FILE_SYSTEMS:
        name = KERNEL_FILE_SYSTEMS.get(kind, f"filesystem type {kind:#x}")
        raise UsageError(f"export: {shown}: must be {what} on a filesystem for files, not on {name}")


class _StatFs(ctypes.Structure):
    """struct statfs: its first field, f_type; room for the rest (120 bytes on 64-bit Linux)."""

    _fields_ = (("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 248))


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.fstatfs.argtypes = (ctypes.c_int, ctypes.POINTER(_StatFs))
_LIBC.fstatfs.restype = ctypes.c_int


def _fs_type(fd: int) -> int:
    """fstatfs(2)'s f_type of `fd` (the standard library has no fstatfs)."""
    result = _StatFs()
    if _LIBC.fstatfs(fd, ctypes.byref(result)) != 0:
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number))
    return int(result.f_type) & 0xFFFFFFFF


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
        check_mine(fd, destination, os.geteuid())
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
        check_mine(directory, destination, os.geteuid(), directory=True)
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


def copy_to_path(source: str, destination: str) -> None:
    """A file of the broker's (a kept export's) as a new file at `destination`."""
    write_file_at(destination, _chunks_of(source))


def copy_to_fd(source: str, fd: int, shown: str, *, uid: int) -> None:
    """A file of the broker's (a kept export's) into `fd`, which a CLI client opened: a new,
    empty file of its account `uid` (check_mine), as deliver_to_file writes an export."""
    check_mine(fd, shown, uid)
    _write_file(fd, _chunks_of(source), shown)
