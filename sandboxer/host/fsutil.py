"""Small filesystem primitives: atomic replacement, private directories, advisory locks, the
mount points this process sees and unmounting one.

Opening and reading files without following symlinks is `sandboxer.core.reading` (the core
reads the owner's files with it); removing and copying whole trees is in `fstree`."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import stat
import tempfile
from collections.abc import Iterator

from sandboxer.errors import PolicyError, UsageError


def write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (a pipe or a full disk may take it in parts)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: str) -> None:
    """Make a rename or unlink inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """Replace `path` with `data` so that readers see the old or the new bytes, never a mix.

    `durable` also fsyncs the file and its directory, so the change survives a power loss; the
    registry of live sandboxes, which a reboot makes meaningless anyway, skips that cost.
    """
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="~")
    try:
        with os.fdopen(fd, "wb") as stream:
            os.fchmod(stream.fileno(), mode)
            stream.write(data)
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    if durable:
        fsync_dir(directory)


def check_private_dir(path: str, what: str, *, traversable: bool = False) -> None:
    """Refuse a directory that is a symlink, not ours, or open to group or others.

    `traversable` allows the search bit for group and others (mode 0711): they may pass
    through to a name they already know, but never list or change the directory.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PolicyError(f"{what} {path}: must be a directory, not a symlink or file")
    if st.st_uid != os.geteuid():
        raise PolicyError(f"{what} {path}: must be owned by uid {os.geteuid()}")
    if st.st_mode & (0o066 if traversable else 0o077):
        raise PolicyError(f"{what} {path}: must be owner-only (mode 0700{' or 0711' if traversable else ''})")


def ensure_private_dir(path: str, what: str = "directory", *, traversable: bool = False) -> None:
    """Create `path` (and missing parents) as 0700 (0711 if `traversable`) when missing; refuse it
    when not private. Parents are made with the same mode, never the umask's (a group-writable
    parent would let others swap what is below it)."""
    mode = 0o711 if traversable else 0o700
    try:
        missing = []
        probe = os.path.abspath(path)
        while not os.path.lexists(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
                os.chmod(directory, mode)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot be created ({exc.strerror})") from None
    check_private_dir(path, what, traversable=traversable)


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created 0600) for the duration of the block.

    flock locks die with their process, so a crashed holder never blocks the next one.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def mount_points() -> list[str]:
    """Every mount point this process's mount namespace shows (mountinfo's octal escapes
    such as \\040 for a space undone)."""
    try:
        with open("/proc/self/mountinfo", "rb") as stream:
            lines = stream.read().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        fields = line.split()
        if len(fields) > 4:
            points.append(_unescape(fields[4]).decode(errors="surrogateescape"))
    return points


def unmount(point: str, *, detach: bool = False) -> None:
    """umount2(2) of `point` (detach: lazily, once nothing uses it any more); OSError says why not.
    A loop device that `mount -o loop` set up for it is freed with it (the kernel's autoclear)."""

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(point.encode(), _MNT_DETACH if detach else 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), point)


_MNT_DETACH = 2


def _unescape(field: bytes) -> bytes:
    out, i = bytearray(), 0
    while i < len(field):
        if field[i : i + 1] == b"\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(int(field[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)
