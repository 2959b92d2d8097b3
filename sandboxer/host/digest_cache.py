"""A verified-stat cache: lets a re-verification of an unchanged runtime skip re-reading files.

An entry maps a relative path to ((device, inode, size, mtime_ns, ctime_ns), sha256). A file is
reused only when all five stat fields match; ctime cannot be set by a process, so restoring
mtime with utime after a same-size edit is still caught. Entries whose ctime or mtime is within
`racy_seconds` of the moment they were hashed are not stored: a write in the same timestamp
tick could otherwise go unseen (git calls this "racily clean").

The cache lives in the broker's owner-only state directory, never inside the runtime. A cache
file that is not ours, not owner-only, or fails its xxh3 checksum is ignored, not trusted. The
body is marshal data (several times faster to load than JSON, which matters on the warm path);
it is only ever read back after the ownership, mode and checksum checks. `digest_runtime` is the
runtime's tree digest (sandboxer.core.digest) through this cache.
"""

from __future__ import annotations

import marshal
import os
import stat
import sys
import time

import xxhash

from sandboxer.core.digest import TreeDigest, tree_digest
from sandboxer.errors import SandboxerError
from sandboxer.host.fsutil import atomic_write, ensure_private_dir

_FORMAT = 2
_MAGIC = b"sandboxer-digest-cache-v2 xxh3-128 "

StatKey = tuple[int, int, int, int, int]
Entry = tuple[StatKey, str]


def _key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class StatCache:
    """Content hashes of one runtime tree, keyed by relative path and checked against stat."""

    def __init__(self, path: str, root: str, *, racy_seconds: float = 2.0) -> None:
        self.path = path
        self.root = root
        self.entries: dict[bytes, Entry] = {}
        self.fresh: dict[bytes, Entry] = {}
        self._horizon_ns = time.time_ns() - int(racy_seconds * 1e9)

    @classmethod
    def for_root(cls, state_dir: str, root: str, *, racy_seconds: float = 2.0, load: bool = True) -> StatCache:
        """The cache of `root` under `state_dir`; empty when `load` is false or none can be trusted."""
        directory = os.path.join(state_dir, "digest-cache")
        name = xxhash.xxh3_64_hexdigest(os.fsencode(root)) + ".cache"
        cache = cls(os.path.join(directory, name), root, racy_seconds=racy_seconds)
        if load:
            cache.entries = _load(cache.path, root)
        return cache

    def lookup(self, relpath: bytes, st: os.stat_result) -> str | None:
        """The recorded content hash if the file's stat is unchanged, else None."""
        entry = self.entries.get(relpath)
        if entry is None or entry[0] != (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return None
        self.fresh[relpath] = entry
        return entry[1]

    def store(self, relpath: bytes, st: os.stat_result, sha256: str) -> None:
        """Record a freshly computed hash unless the file changed too recently to trust stat."""
        if max(st.st_ctime_ns, st.st_mtime_ns) < self._horizon_ns:
            self.fresh[relpath] = (_key(st), sha256)

    def save(self) -> None:
        """Replace the cache file with the entries seen in this walk, if they differ from it."""
        if self.fresh == self.entries:
            return
        ensure_private_dir(os.path.dirname(self.path))
        data = marshal.dumps({"format": _FORMAT, "root": self.root, "entries": self.fresh}, 4)
        atomic_write(self.path, _MAGIC + xxhash.xxh3_128_hexdigest(data).encode() + b"\n" + data)


def _load(path: str, root: str) -> dict[bytes, Entry]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as stream:
        st = os.fstat(stream.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return {}
        header = stream.readline()
        data = stream.read()
    if not header.startswith(_MAGIC) or header[len(_MAGIC) :].strip() != xxhash.xxh3_128_hexdigest(data).encode():
        return {}
    try:
        document = marshal.loads(data)  # noqa: S302 - owner-only, ours, checksum verified above
    except (EOFError, ValueError, TypeError):
        return {}
    if not isinstance(document, dict) or document.get("format") != _FORMAT or document.get("root") != root:
        return {}
    entries = document.get("entries")
    if not isinstance(entries, dict):
        return {}
    # Checked once here so that lookup, which runs per file, can trust the shapes.
    for key, entry in entries.items():
        if not (type(key) is bytes and type(entry) is tuple and len(entry) == 2 and type(entry[1]) is str):
            return {}
        if type(entry[0]) is not tuple or len(entry[0]) != 5:
            return {}
    return entries


def digest_runtime(path: str, *, state_dir: str | None, full: bool = False) -> TreeDigest:
    """Tree digest v1 of `path`, reusing the verified-stat cache in `state_dir` unless `full`.

    A `full` digest re-reads every byte and then refreshes the cache. Without a usable state
    directory the digest is computed without a cache: slower, never different.
    """
    cache: StatCache | None = None
    if state_dir is not None:
        cache = StatCache.for_root(state_dir, path, load=not full)
    result = tree_digest(path, cache=cache)
    if cache is not None and state_dir is not None:
        try:
            ensure_private_dir(state_dir, "state dir", traversable=os.geteuid() == 0)
            cache.save()
        except (OSError, SandboxerError) as exc:
            print(f"sandboxer: warning: digest cache not saved ({exc})", file=sys.stderr)
    return result
