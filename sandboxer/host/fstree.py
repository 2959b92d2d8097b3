"""Removing and copying whole trees by descriptors: no recursion, no symlink followed, never
leaving the mount a removal starts on (teardown and gc remove what a sandbox left; an
unprivileged broker's clone is copied into the sandbox's own workspace)."""

from __future__ import annotations

import errno
import os
import shutil
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# --- removing a tree a sandbox had ----------------------------------------------------------------


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


# --- copying a clone into a workspace -------------------------------------------------------------


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
