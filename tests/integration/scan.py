"""Looking for a secret in every file below a directory, as the leak tests do.

A sandbox's state dir holds sparse files as large as its sized filesystems (a workspace image of
`limits.workspace_mib`); reading their holes would take most of a test's time and prove nothing,
since a hole holds only zeros. So each file is read in its data extents (SEEK_DATA, SEEK_HOLE),
a chunk at a time, the chunks overlapping by the needle's length less one."""

from __future__ import annotations

import errno
import os
import stat

CHUNK = 1 << 20


def files_holding(root: str | os.PathLike[str], needles: list[bytes]) -> list[str]:
    """Every regular file below `root` (symlinks not followed) whose content holds a needle."""
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            try:
                if stat.S_ISREG(os.lstat(path).st_mode) and _holds(path, needles):
                    found.append(path)
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def _holds(path: str, needles: list[bytes]) -> bool:
    keep = max(len(needle) for needle in needles) - 1
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size, offset = os.fstat(fd).st_size, 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole to the end
                    return False
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            tail = b""
            position = start
            while position < end:
                chunk = os.pread(fd, min(CHUNK, end - position), position)
                if not chunk:
                    break
                window = tail + chunk
                if any(needle in window for needle in needles):
                    return True
                tail = window[-keep:] if keep else b""
                position += len(chunk)
            offset = end
        return False
    finally:
        os.close(fd)
