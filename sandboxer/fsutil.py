"""Small filesystem primitives: atomic replacement, private directories, advisory locks, and
removing and copying trees by descriptors."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

from sandboxer.errors import PolicyError, UsageError


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
    """Create `path` (and parents) as 0700 (0711 if `traversable`) when missing; refuse it when not private."""
    try:
        os.makedirs(path, mode=0o700)
        if traversable:
            os.chmod(path, 0o711)  # noqa: S103 - passable, not listable; see Registry.ensure
    except FileExistsError:
        pass
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


def read_owner_only(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    """Read a file once: a regular file, not a symlink, with no group or other permission bits,
    at most `limit` bytes. Raises UnfitFile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UnfitFile("is a symlink" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnfitFile("must be a regular file")
        if info.st_mode & 0o077:
            raise UnfitFile("must be owner-only (no group or other permissions)")
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > limit:
                raise UnfitFile(f"is larger than {limit} bytes")
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), info


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


# --- removing a tree a sandbox had ----------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Level:
    """One directory on the way down: where it is, what is left to enter, what stays."""

    __slots__ = ("kept", "key", "name", "pending")

    def __init__(self, name: str, info: os.stat_result) -> None:
        self.name = name  # in its parent
        self.key = (info.st_dev, info.st_ino)  # checked again when ".." brings us back here
        self.pending: list[str] = []  # subdirectories still to enter
        self.kept: set[str] = set()  # entries that could not be removed: never tried twice


def remove_tree(path: str) -> bool:
    """Remove `path` and everything below it; whether it is gone.

    Made for trees a sandbox shaped to hurt: any depth (no recursion, and one directory open at
    a time however deep; the way back up is "..", checked against the device and inode
    remembered on the way down), any width, directories without read, write or search bits
    (given them through a descriptor of the directory itself), symlinks (unlinked, never
    followed). It never leaves the mount `path` is on: a mount point below is not entered, so it,
    what is mounted there and the directories above it stay (False). Callers run it once nothing
    else writes in the tree; `path` itself is the broker's own and is resolved as given.
    """
    head, name = os.path.split(path.rstrip("/"))
    if name in ("", ".", ".."):
        raise ValueError(f"remove_tree: not a removable path: {path!r}")
    try:
        parent = os.open(head or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        return _remove_at(parent, name)
    finally:
        os.close(parent)


def _remove_at(parent: int, name: str) -> bool:
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(info.st_mode):
        return _unlink(parent, name)
    mount = _mount_id(parent)
    here = _enter(parent, name, info, info.st_dev, mount)
    if here is None:  # a mount point itself, or it cannot be opened
        return False
    complete = _empty(here, _Level(name, info), info.st_dev, mount)  # closes `here`
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return complete


def _empty(here: int, top: _Level, device: int, mount: int | None) -> bool:
    """Remove everything below the open directory `here` (the level `top`); closes `here`."""
    levels, complete = [top], True
    try:
        while True:
            level = levels[-1]
            if not level.pending:
                complete &= _clear(here, level)
            if level.pending:
                child = level.pending.pop()
                try:
                    info = os.stat(child, dir_fd=here, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError:
                    info = None
                inner = None if info is None else _enter(here, child, info, device, mount)
                if info is None or inner is None:
                    level.kept.add(child)
                    complete = False
                    continue
                os.close(here)
                here = inner
                levels.append(_Level(child, info))
                continue
            if len(levels) == 1:
                return complete
            # Back up through "..": it must be the directory we came down from (nothing moved).
            up = os.open("..", _DIR_FLAGS, dir_fd=here)
            done = levels.pop()
            up_info = os.fstat(up)
            os.close(here)
            here = up
            if (up_info.st_dev, up_info.st_ino) != levels[-1].key:
                return False
            try:
                os.rmdir(done.name, dir_fd=here)
            except FileNotFoundError:
                pass
            except OSError:  # not empty (something below stays) or a mount point
                levels[-1].kept.add(done.name)
                complete = False
    except OSError:
        return False
    finally:
        os.close(here)


def _clear(here: int, level: _Level) -> bool:
    """Unlink every entry of `here` but directories, which go to `level.pending`."""
    complete = True
    with os.scandir(here) as entries:
        for entry in entries:
            if entry.name in level.kept:
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    level.pending.append(entry.name)
                    continue
                os.unlink(entry.name, dir_fd=here)
            except FileNotFoundError:
                continue
            except OSError:
                level.kept.add(entry.name)
                complete = False
    return complete


def _unlink(parent: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _enter(parent: int, name: str, seen: os.stat_result, device: int, mount: int | None) -> int | None:
    """A read descriptor of the directory `name` of `parent`, the one `seen` (same device and
    inode) and on the same mount, that we may list, search and change; None when it is not."""
    if not stat.S_ISDIR(seen.st_mode) or seen.st_dev != device:
        return None
    try:
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except PermissionError:  # no read bit: only an unprivileged owner gets here
            _grant_owner(parent, name, seen)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        same = (info.st_dev, info.st_ino) == (seen.st_dev, seen.st_ino)
        if not same or (mount is not None and _mount_id(fd) != mount):
            os.close(fd)
            return None
        if info.st_mode & stat.S_IRWXU != stat.S_IRWXU:  # as root the bits do not matter; harmless
            os.fchmod(fd, stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
    except OSError:
        os.close(fd)
        return None
    return fd


def _grant_owner(parent: int, name: str, seen: os.stat_result) -> None:
    """chmod u+rwx the directory `seen` through an O_PATH descriptor of it: never by a name that
    could meanwhile be a symlink. Raises OSError."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != (seen.st_dev, seen.st_ino):
            raise OSError(errno.ESTALE, "changed while it was removed", name)
        # fchmod refuses O_PATH descriptors; the /proc link resolves to the same inode.
        os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(info.st_mode) | stat.S_IRWXU)
    finally:
        os.close(fd)


def _mount_id(fd: int) -> int | None:
    """The id of the mount `fd` is on (from /proc/self/fdinfo), or None without /proc.

    st_dev alone misses a bind mount from the same filesystem; the mount id tells them apart."""
    try:
        info = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(info, 4096)
    finally:
        os.close(info)
    for line in data.splitlines():
        if line.startswith(b"mnt_id:"):
            return int(line.split()[1])
    return None


def copy_tree(source: str, target: int) -> None:
    """Copy the tree at `source` into the empty directory open as `target`, by descriptors.

    Directories (their permission bits, with the owner's rwx), regular files (contents, permission
    bits, modification time) and symbolic links (as links) are copied; anything else is refused
    (a workspace clone has nothing else). No link is followed on either side and no recursion is
    used, so neither a deep tree nor a link planted in the target can lead it elsewhere. OSError
    as it happens (ENOSPC when the target's
    filesystem is full); what was copied stays for the caller to discard.
    """
    pending = [(os.open(source, _DIR_FLAGS), os.dup(target))]
    try:
        while pending:
            here, there = pending.pop()
            try:
                with os.scandir(here) as entries:
                    for entry in entries:
                        pending += _copy_entry(here, there, entry.name, entry.stat(follow_symlinks=False))
            finally:
                os.close(here)
                os.close(there)
    finally:
        for here, there in pending:
            os.close(here)
            os.close(there)


def _copy_entry(here: int, there: int, name: str, seen: os.stat_result) -> list[tuple[int, int]]:
    """Copy one entry of directory `here` into `there`; a directory is returned to descend into."""
    mode = stat.S_IMODE(seen.st_mode)
    if stat.S_ISDIR(seen.st_mode):
        os.mkdir(name, 0o700, dir_fd=there)
        below = os.open(name, _DIR_FLAGS, dir_fd=there)
        try:
            os.chmod(below, mode | 0o700)  # its owner keeps the right to fill it
            return [(os.open(name, _DIR_FLAGS, dir_fd=here), below)]
        except BaseException:
            os.close(below)
            raise
    if stat.S_ISLNK(seen.st_mode):
        os.symlink(os.readlink(name, dir_fd=here), name, dir_fd=there)
    elif stat.S_ISREG(seen.st_mode):
        reader = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
        with open(reader, "rb") as original:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with open(os.open(name, flags, 0o600, dir_fd=there), "wb") as copy:
                shutil.copyfileobj(original, copy, 1 << 20)
                os.chmod(copy.fileno(), mode)
    else:
        raise OSError(errno.EINVAL, "neither a directory, a regular file nor a symbolic link", name)
    os.utime(name, ns=(seen.st_atime_ns, seen.st_mtime_ns), dir_fd=there, follow_symlinks=False)
    return []
