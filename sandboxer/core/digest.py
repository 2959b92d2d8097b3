"""Tree digest v1 of a runtime directory, with the artifact rules checked during the same walk.

Format (docs/owner-guide.md publishes it): one record per entry, the root itself as `.`, sorted
by the relative path as bytes, concatenated and hashed with sha256:

    directory  D\\0<relpath>\\0<mode>\\n
    file       F\\0<relpath>\\0<mode>\\0<sha256 hex>\\n
    symlink    L\\0<relpath>\\0<target as stored>\\n

`<mode>` is `st_mode & 0o7777` as four octal digits. A `StatCache` (host/digest_cache.py) may
supply a file's content hash when its inode, size, mtime and ctime are unchanged; the digest is
the same either way.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Protocol

from sandboxer.errors import UsageError


class StatCache(Protocol):
    """Content hashes of files whose stat is unchanged since they were hashed (the host keeps
    them: host/digest_cache.py)."""

    def lookup(self, relpath: bytes, st: os.stat_result) -> str | None:
        """The recorded content hash if the file's stat is unchanged, else None."""

    def store(self, relpath: bytes, st: os.stat_result, sha256: str) -> None:
        """Offer a freshly computed hash."""


_SMALL_FILE = 1 << 20


class RuntimeArtifactError(UsageError):
    """The runtime directory is not an acceptable artifact; the message names the relative path."""

    kind = "runtime-artifact"


@dataclass(frozen=True, slots=True, kw_only=True)
class TreeDigest:
    """The digest of a tree and what it took to compute it."""

    sha256: str
    entries: int
    files: int
    bytes: int
    bytes_read: int
    reused: int


def _show(relpath: bytes) -> str:
    return relpath.decode("utf-8", "backslashreplace")


def canonical_directory(path: str) -> str:
    """Return `path` if it is a canonical absolute directory (no symlink, `..` or trailing slash)."""
    if not os.path.isabs(path):
        raise RuntimeArtifactError(f"runtime {path}: must be an absolute path")
    if os.path.realpath(path) != path:
        raise RuntimeArtifactError(f"runtime {path}: must be canonical (no symlink, '.', '..' or trailing slash)")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RuntimeArtifactError(f"runtime {path}: does not exist") from None
    except OSError as exc:
        raise RuntimeArtifactError(f"runtime {path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeArtifactError(f"runtime {path}: must be a directory")
    return path


def _hash_file(path: bytes, expected: os.stat_result) -> str:
    # O_NOFOLLOW and O_NONBLOCK: a file swapped for a symlink or FIFO after lstat cannot redirect
    # or hang the read; the inode check below then refuses the swap.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if (st.st_ino, st.st_dev) != (expected.st_ino, expected.st_dev) or not stat.S_ISREG(st.st_mode):
            raise RuntimeArtifactError("runtime changed while it was being read")
        if st.st_size <= _SMALL_FILE:
            chunks = []
            while chunk := os.read(fd, _SMALL_FILE + 1):
                chunks.append(chunk)
            return hashlib.sha256(b"".join(chunks)).hexdigest()
        with os.fdopen(fd, "rb", closefd=False) as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    finally:
        os.close(fd)


def _escapes(broot: bytes, relpath: bytes, target: bytes) -> bool:
    """Resolve a link inside the tree as if the tree were `/`: does any step climb above it?

    Lexical checks miss a climb through another internal link (`up -> ..`); the host's realpath
    misses a climb that comes back by the tree's own name (`../runtime/x`), which points
    elsewhere once the tree is mounted under another name. Walking component by component,
    following every internal link, catches both.
    """
    stack = relpath.split(b"/")[:-1]
    pending = [part for part in target.split(b"/") if part not in (b"", b".")]
    pending.reverse()
    hops = 0
    while pending:
        part = pending.pop()
        if part == b"..":
            if not stack:
                return True
            stack.pop()
            continue
        stack.append(part)
        try:
            link = os.readlink(os.path.join(broot, *stack))
        except OSError:
            continue  # not a link (or absent): nothing more to follow here
        hops += 1
        if link.startswith(b"/") or hops > 40:
            return True
        stack.pop()
        pending.extend(reversed([p for p in link.split(b"/") if p not in (b"", b".")]))
    return False


def _check_symlink(broot: bytes, relpath: bytes, target: bytes) -> None:
    if target.startswith(b"/"):
        raise RuntimeArtifactError(f"runtime {_show(relpath)}: absolute symlink")
    if _escapes(broot, relpath, target):
        raise RuntimeArtifactError(f"runtime {_show(relpath)}: symlink escapes the runtime")


def _read_hash(full: bytes, relpath: bytes, st: os.stat_result, cache: StatCache | None) -> str:
    """Read and hash one file, and offer the result to the cache."""
    try:
        content = _hash_file(full, st)
    except OSError as exc:
        raise RuntimeArtifactError(f"runtime {_show(relpath)}: cannot be read ({exc.strerror})") from None
    if cache is not None:
        cache.store(relpath, st, content)
    return content


def _check_mode(relpath: bytes, mode: int) -> None:
    if mode & stat.S_IWOTH:
        raise RuntimeArtifactError(f"runtime {_show(relpath)}: world-writable")
    if mode & (stat.S_ISUID | stat.S_ISGID) and not stat.S_ISDIR(mode):
        raise RuntimeArtifactError(f"runtime {_show(relpath)}: setuid or setgid file")


_SUSPICIOUS_BITS = stat.S_IWOTH | stat.S_ISUID | stat.S_ISGID


def tree_digest(root: str, *, cache: StatCache | None = None) -> TreeDigest:
    """Digest the canonical directory `root`, refusing anything a runtime must not contain."""
    canonical_directory(root)
    broot = os.fsencode(root)
    records: list[tuple[bytes, bytes]] = []
    files = total_bytes = bytes_read = reused = 0
    lookup = cache.lookup if cache is not None else None
    s_isdir, s_isreg = stat.S_ISDIR, stat.S_ISREG  # the loop below runs once per entry: keep it lean

    root_st = os.lstat(broot)
    _check_mode(b".", root_st.st_mode)
    records.append((b".", b"D\0.\0%04o\n" % (root_st.st_mode & 0o7777)))
    pending: list[tuple[bytes, bytes]] = [(broot, b"")]
    while pending:
        directory, prefix = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError as exc:
            shown = _show(prefix.rstrip(b"/") or b".")
            raise RuntimeArtifactError(f"runtime {shown}: cannot be read ({exc.strerror})") from None
        for entry in entries:
            relpath = prefix + entry.name
            st = entry.stat(follow_symlinks=False)
            mode = st.st_mode
            if mode & _SUSPICIOUS_BITS and not stat.S_ISLNK(mode):
                _check_mode(relpath, mode)
            if s_isreg(mode):
                files += 1
                total_bytes += st.st_size
                content = lookup(relpath, st) if lookup is not None else None
                if content is None:
                    content = _read_hash(entry.path, relpath, st, cache)
                    bytes_read += st.st_size
                else:
                    reused += 1
                records.append((relpath, b"F\0%s\0%04o\0%s\n" % (relpath, mode & 0o7777, content.encode())))
            elif s_isdir(mode):
                records.append((relpath, b"D\0%s\0%04o\n" % (relpath, mode & 0o7777)))
                pending.append((entry.path, relpath + b"/"))
            elif stat.S_ISLNK(mode):
                target = os.readlink(entry.path)
                _check_symlink(broot, relpath, target)
                records.append((relpath, b"L\0%s\0%s\n" % (relpath, target)))
            else:
                raise RuntimeArtifactError(f"runtime {_show(relpath)}: special file (not a file, directory or symlink)")

    _check_layout(broot)
    records.sort()  # relative paths are unique, so this orders by path bytes alone
    return TreeDigest(
        sha256=hashlib.sha256(b"".join(record for _, record in records)).hexdigest(),
        entries=len(records),
        files=files,
        bytes=total_bytes,
        bytes_read=bytes_read,
        reused=reused,
    )


def _check_layout(broot: bytes) -> None:
    try:
        cfg = os.lstat(os.path.join(broot, b"pyvenv.cfg"))
    except OSError:
        cfg = None
    if cfg is None or not stat.S_ISREG(cfg.st_mode):
        raise RuntimeArtifactError("runtime pyvenv.cfg: missing or not a regular file")
    python = os.path.realpath(os.path.join(broot, b"bin", b"python3"))
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise RuntimeArtifactError("runtime bin/python3: missing or not an executable file")
